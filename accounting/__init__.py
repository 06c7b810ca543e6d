"""Privacy accounting: definitions, sensitivities, allocation, composition, manifest model.

This package imports nothing from the engines or the pipelines: the privacy
arithmetic is the same whatever runs the release.
"""
