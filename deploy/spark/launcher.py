"""Entry point for spark-submit: runs the dprelease CLI inside the submitted driver."""
from dprelease.pipelines.cli import entry

if __name__ == "__main__":
    entry()
