"""A block-level release on Spark (blocks_spec.yaml: hierarchy nation > state > county > tract > block and a
PL94-like histogram of 1,584 cells per block), at growing numbers of blocks: wall time per stage, published
cells per second, the bytes of the release the driver read back from the store, and the peak resident memory
of the driver (this Python process) and of its JVM (in local mode the JVM holds the executors too), sampled every
0.1 s, and the peak bytes under the driver's
temporary directory (a fresh one per run: what the driver stages on its own disk). The driver's JVM gets
`--driver-memory` (default 1g). `--out` publishes elsewhere, an object store for one
(s3://bucket/releases?endpoint_override=127.0.0.1:PORT&scheme=http, credentials from the environment); with
`--master spark://...` the executors of a standalone cluster (deploy/spark/start-cluster.sh) write the parts. Usage:
    python benchmarks/spark_blocks.py [--blocks N ...] [--rows R] [--master URL] [--driver-memory 1g] [--out DIR|URI]
Data (persons and geography) is generated once per size under benchmarks/out/blocks-N/.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


class ReadBack:
    """Bytes of the store's objects this process (the driver) read back after copying them into the release
    (`storage.objects._object_sha256`): with an engine whose workers copy the parts, none."""

    def __init__(self) -> None:
        from dprelease.pipelines.storage import objects

        self.bytes = 0
        digest = objects._object_sha256

        def counted(filesystem, path: str) -> str:
            self.bytes += filesystem.get_file_info(path).size
            return digest(filesystem, path)

        objects._object_sha256 = counted


def tree_bytes(root: Path) -> int:
    """Bytes of the regular files below `root` (links not followed)."""
    total = 0
    for directory, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(directory, name)).st_size
            except OSError:
                pass
    return total


class PeakMemory(threading.Thread):
    """Largest RSS of this process, of its JVM (a `java` child) and of all Python workers together, and the
    largest size of the driver's temporary directory."""

    def __init__(self, temporary: Path) -> None:
        super().__init__(daemon=True)
        self.driver = self.jvm = self.workers = self.staged = 0
        self.temporary = temporary
        self.running = True

    def run(self) -> None:
        me = os.getpid()
        while self.running:
            self.driver = max(self.driver, resident_bytes(me))
            self.staged = max(self.staged, tree_bytes(self.temporary))
            workers = 0
            for child in children(me):
                name = Path(f"/proc/{child}/comm").read_text().strip() if Path(f"/proc/{child}/comm").exists() else ""
                if name == "java":
                    self.jvm = max(self.jvm, resident_bytes(child))
                    workers += sum(resident_bytes(g) + sum(resident_bytes(w) for w in children(g))
                                   for g in children(child))
            self.workers = max(self.workers, workers)
            time.sleep(0.1)


def data_for(blocks: int, rows: int) -> Path:
    data = HERE / "out" / f"blocks-{blocks}-{rows}"
    if not (data / "persons.parquet").exists():
        tracts = max(1, min(44_627, blocks // 8))
        counties = max(1, min(3_577, tracts // 4))
        subprocess.run(["dprelease", "demo-data", "--rows", str(rows), "--out", str(data), "--states",
                        str(min(51, counties)), "--counties", str(counties), "--tracts", str(tracts),
                        "--blocks", str(blocks)], check=True, stdout=subprocess.DEVNULL)
    return data


def measure(blocks: int, rows: int, master: str, target: str | None) -> None:
    from dprelease.pipelines.plan import build_plan
    from dprelease.pipelines.run import run_release
    from dprelease.pipelines.spec import load_spec

    data = data_for(blocks, rows)
    shutil.copy(data / "geography.txt", HERE / "out" / "blocks" / "geography.txt")
    spec_path = HERE / "blocks_spec.yaml"
    spec, base = load_spec(spec_path)
    cells = build_plan(spec, base).n_cells
    out = target or HERE / "out" / "spark-blocks"
    if target is None:
        shutil.rmtree(out, ignore_errors=True)
    marks: list[tuple[str, float]] = []
    temporary = Path(tempfile.mkdtemp(prefix="spark-blocks-driver-"))
    os.environ["TMPDIR"] = tempfile.tempdir = str(temporary)  # the driver's (and its JVM's) temporary files
    peak = PeakMemory(temporary)
    peak.start()
    read_back = ReadBack()
    start = time.perf_counter()
    run_release(spec_path, input_path=str(data / "persons.parquet"), out_dir=out, engine="spark", master=master,
                ledger=None, key_file=HERE / "out" / "keys" / f"blocks-{blocks}.key", overwrite=target is not None,
                progress=lambda stage, done, total: marks.append((f"{stage} {done}/{total}", time.perf_counter())))
    wall = time.perf_counter() - start
    peak.running = False
    peak.join()
    gib = 1 << 30
    print(f"{blocks:>9,} blocks {cells:>13,} cells {rows:>11,} rows  wall {wall:8.1f} s  {cells / wall:>11,.0f} cells/s  "
          f"driver {peak.driver / gib:.2f} GiB  JVM {peak.jvm / gib:.2f} GiB  python workers {peak.workers / gib:.2f} GiB  "
          f"driver's temporary directory at most {peak.staged / (1 << 20):.1f} MiB  "
          f"read back by the driver {read_back.bytes / (1 << 20):,.0f} MiB")
    shutil.rmtree(temporary, ignore_errors=True)
    previous = start
    for label, at in marks:
        print(f"    {label:<24} {at - previous:8.1f} s")
        previous = at
    print(f"    {'publish':<24} {start + wall - previous:8.1f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, nargs="+", default=[17_000, 340_000])
    parser.add_argument("--rows", type=int, default=5_000_000)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--driver-memory", default="1g")
    parser.add_argument("--out", help="publish here (a directory or a store URI; replaced each run) instead of "
                                      "benchmarks/out/spark-blocks")
    args = parser.parse_args()
    os.environ["PYSPARK_SUBMIT_ARGS"] = f"--driver-memory {args.driver_memory} pyspark-shell"
    (HERE / "out" / "blocks").mkdir(parents=True, exist_ok=True)
    for blocks in args.blocks:
        measure(blocks, args.rows, args.master, args.out)


if __name__ == "__main__":
    main()
