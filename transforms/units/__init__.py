"""Post-processing per geographic unit: the least-squares estimate, its variances, the integer step and
the joint fit of marginals, as kernels over batches of units that any engine can run where the data is.

When a release's count tables form a tree of geographic units (`tree.decompose`: one geography column,
attributes shared across levels only where every table carries them), the global generalised
least-squares estimate is two passes over the levels (Hay et al. 2010, generalised to blocks of tables
per unit and to unequal variances):
    up    per unit: its block's own estimate of its total, combined with its children's subtree
          estimates (a group-by on the parent's code, leaves first);
    down  per parent: its final total shared among its children by their subtree variances, then each
          child's block estimate conditioned on its final total (root first);
and the integer step runs in the same down pass, per parent: hierarchy children fitted to the parent's
integers, each unit's marginals from a joint table fitted to its noisy tables with the unit's integer
total. Every kernel computes a unit from its own data and its parent's, in a fixed order of operations
and fixed-width chunks, so its result is bit for bit the same in any batch, worker or engine.

Privacy: post-processing. The kernels read noisy measurements, their public variances and the public
plan (domains, tables, parent maps) only.
"""
