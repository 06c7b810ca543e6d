"""dprelease's `select: aim` records against the reference AIM (Private-PGM's `mechanisms/aim.py`, McKenna et
al. 2022) on UCI Adult, in the same run: mean L1 error over all 2-way and all 3-way marginals of the normalised
tabulation of each method's records (the project's metric: twice the total variation distance), wall time and
peak memory of each run (a child process each: release + synthesis for dprelease; the mechanism and its
synthetic data for the reference).

The reference runs from its own repository and environment (JAX), unmodified, with its default workload (every
3-way marginal of at most 10,000 cells, weight 1), max_model_size 80 and 1000 iterations a round, and `rounds`
capped (default 40; its own default, 16 x attributes, takes hours); dprelease runs the spec of
`examples/adult/synthetic_aim.yaml`'s query at the same (epsilon, delta), default degree 2.
Evaluation only: it reads the true data. Not part of the test run.
Usage: python benchmarks/aim_reference.py --reference-python /path/to/venv/bin/python
         --reference-src /path/to/private-pgm [--epsilons 0.3,1,3] [--keys 5] [--seeds 1] [--rounds 40]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic_adult import DATA, DELTA, DOMAIN, true_records, workload_error  # noqa: E402

DPRELEASE_CHILD = """
import sys, numpy as np
from pathlib import Path
sys.path.insert(0, {bench!r})
from fractions import Fraction
from synthetic_adult import dprelease_records, true_records
from dprelease.accounting.conversions import approx_to_zcdp
_, columns, _ = true_records()
records = dprelease_records(approx_to_zcdp(Fraction({epsilon!r}), {delta!r}), columns, Path({work!r}), {run!r}, "aim")
np.save({out!r}, records)
"""

REFERENCE_CHILD = """
import itertools, sys
sys.path.insert(0, {mechanisms!r})
import numpy as np
from mbi import Dataset
from aim import AIM
data = Dataset.load({data!r}, {domain!r})
workload = [(cl, 1.0) for cl in itertools.combinations(data.domain, 3) if data.domain.size(cl) <= 10000]
np.random.seed({seed})  # the reference draws from numpy's global generator (its AIM passes no prng on)
mechanism = AIM({epsilon!r}, {delta!r}, rounds={rounds}, max_model_size=80, max_iters=1000)
_, synth = mechanism.run(data, workload)
synth.df.to_csv({out!r}, index=False)
"""


def timed_child(python: str, code: str, cwd: Path) -> tuple[float, float]:
    """(wall seconds, peak resident GiB) of a child process running `code`."""
    start = time.perf_counter()
    with tempfile.TemporaryFile() as errors:  # a file, not a pipe: a pipe no one reads blocks a chatty child for good
        child = subprocess.Popen([python, "-c", code], cwd=cwd, stdout=subprocess.DEVNULL, stderr=errors)
        _, status, usage = os.wait4(child.pid, 0)
        seconds = time.perf_counter() - start
        if status != 0:
            errors.seek(0)
            raise RuntimeError(f"child failed: {errors.read().decode(errors='replace')[-3000:]}")
    return seconds, usage.ru_maxrss / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference-python", required=True, help="a Python with Private-PGM's mbi installed")
    parser.add_argument("--reference-src", required=True, type=Path, help="a Private-PGM checkout (mechanisms/)")
    parser.add_argument("--epsilons", default="0.3,1,3")
    parser.add_argument("--keys", type=int, default=5, help="dprelease runs per epsilon (a fresh key each)")
    parser.add_argument("--seeds", type=int, default=1, help="reference runs per epsilon")
    parser.add_argument("--rounds", type=int, default=40, help="the reference's rounds")
    parser.add_argument("--json", type=Path, help="write every run's row here as well")
    args = parser.parse_args()
    truth, columns, domain = true_records()
    sizes = [domain[c] for c in columns]
    rows = []
    with tempfile.TemporaryDirectory(prefix="aim-reference-") as tmp:
        work = Path(tmp)
        for epsilon in args.epsilons.split(","):
            runs = [("dprelease", i) for i in range(args.keys)] + [("reference", i) for i in range(args.seeds)]
            for method, i in runs:
                out = work / f"{method}-{epsilon}-{i}"
                if method == "dprelease":
                    code = DPRELEASE_CHILD.format(bench=str(Path(__file__).resolve().parent), epsilon=epsilon,
                                                  delta=DELTA, work=str(work), run=f"{epsilon}-{i}",
                                                  out=str(out) + ".npy")
                    seconds, gib = timed_child(sys.executable, code, work)
                    records = np.load(str(out) + ".npy")
                else:
                    code = REFERENCE_CHILD.format(mechanisms=str(args.reference_src / "mechanisms"), data=str(DATA),
                                                  domain=str(DOMAIN), epsilon=float(Fraction(epsilon)), delta=DELTA,
                                                  seed=i, rounds=args.rounds, out=str(out) + ".csv")
                    seconds, gib = timed_child(args.reference_python, code, work)
                    records = np.loadtxt(str(out) + ".csv", delimiter=",", skiprows=1, dtype=np.int64)
                row = {"epsilon": float(Fraction(epsilon)), "method": method, "run": i,
                       "error2": workload_error(records, truth, sizes, 2),
                       "error3": workload_error(records, truth, sizes, 3), "seconds": seconds, "peak_gib": gib}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(f"\n{'epsilon':8} {'method':10} {'2-way':>8} {'3-way':>8} {'seconds':>8} {'GiB':>6}  runs")
    for epsilon in sorted({r["epsilon"] for r in rows}):
        for method in ("dprelease", "reference"):
            found = [r for r in rows if r["epsilon"] == epsilon and r["method"] == method]
            if found:
                print(f"{epsilon:<8} {method:10} {np.mean([r['error2'] for r in found]):8.4f} "
                      f"{np.mean([r['error3'] for r in found]):8.4f} {np.mean([r['seconds'] for r in found]):8.1f} "
                      f"{max(r['peak_gib'] for r in found):6.2f}  {len(found)}")


if __name__ == "__main__":
    main()
