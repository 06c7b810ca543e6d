"""One distribution, `dprelease`, installing the top-level folders under one package.

api/ -> dprelease (the Python API), pipelines/ -> dprelease.pipelines, transforms/ -> dprelease.transforms,
accounting/ -> dprelease.accounting, examples/ -> dprelease.examples. No generic top-level name (such as
`pipelines`) is installed into site-packages.
"""
from pathlib import Path

from setuptools import Extension, setup

TOP_LEVEL_FOLDERS = ("pipelines", "transforms", "accounting", "examples")


def packages_under(folders: tuple[str, ...]) -> dict[str, str]:
    """Every folder holding an `__init__.py`, mapped to its `dprelease.` package name.

    Found rather than listed, so a new subpackage can never be left out of a
    non-editable install (as `transforms/units` once was).
    """
    found = {}
    for folder in folders:
        for init in sorted(Path(folder).rglob("__init__.py")):
            relative = init.parent.as_posix()
            found["dprelease." + relative.replace("/", ".")] = relative
    return found


PACKAGES = {"dprelease": "api", **packages_under(TOP_LEVEL_FOLDERS)}
"""api/ is the `dprelease` package itself (its __init__ is the Python API: `import dprelease`)."""

setup(
    name="dprelease",
    version="0.1.0",
    description="Differentially private statistical releases: census-style tables, exact noise, verifiable manifests",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=list(PACKAGES),
    package_dir=PACKAGES,
    package_data={
        "dprelease.examples": ["demo/*.yaml", "adult/*.yaml"],
        "dprelease.accounting": ["manifest.schema.json"],
        "dprelease.pipelines": ["templates/*.j2"],
    },
    install_requires=[
        "numpy>=1.26",
        "scipy>=1.11",
        "pyarrow>=14",
        "pydantic>=2.5",
        "PyYAML>=6",
        "cryptography>=41",
        "click>=8.1",
        "rich>=13",
        "SQLAlchemy>=2.0",
        "platformdirs>=3",
        "pandas>=2.2,<3",  # the Python API's tables and plans are DataFrames (pandas 3 is not yet tested on)
        "jinja2>=3.1",  # the report page, autoescaped
        "matplotlib>=3.8",  # the report's figures, as inline SVG
    ],
    extras_require={
        "test": ["pytest>=7.4", "pytest-xdist>=3.5", "scipy>=1.11", "dp-accounting>=0.4", "opendp>=0.12", "jsonschema>=4",
                 "psycopg[binary]>=3.1", "moto[server]>=5",
                 "polars>=1", "nbclient>=0.10", "ipykernel>=6", "nbformat>=5.1",
                 "mkdocs>=1.6", "mkdocstrings[python]>=0.26", "pymdown-extensions>=10"],
        "spark": ["pyspark>=4.0", "pandas>=2.2,<3"],
        "beam": ["apache-beam>=2.60"],
        # pandas 3 is not yet what the suite is tested on (CI installs every extra: pandas < 3 via spark)
        "validate": ["great_expectations>=1.5", "pandas>=2.2,<3"],
        "bench": ["psutil>=5.9"],
    },
    ext_modules=[Extension("dprelease.transforms._exact", ["transforms/_exact.c"], extra_compile_args=["-O3"]),
                 Extension("dprelease.transforms._segments", ["transforms/_segments.c"], extra_compile_args=["-O3"]),
                 Extension("dprelease.transforms._counting", ["transforms/_counting.c"], extra_compile_args=["-O3"],
                           depends=["transforms/_signed_buffer.h"]),
                 Extension("dprelease.transforms._encoding", ["transforms/_encoding.c"], extra_compile_args=["-O3"],
                           depends=["transforms/_signed_buffer.h"]),
                 Extension("dprelease.transforms._joint", ["transforms/_joint.c"],
                           extra_compile_args=["-O3", "-ffp-contract=off"])],
    entry_points={"console_scripts": ["dprelease=dprelease.pipelines.cli:entry"]},
)
