"""``python -m vsekit.cli``: the ``vsekit`` command (what ``--nproc-per-node`` starts on each rank)."""

from . import main

if __name__ == "__main__":
    main(prog_name="vsekit")
