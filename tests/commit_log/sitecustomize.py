"""Test instrumentation loaded by every Python process whose PYTHONPATH starts with this folder
(the SLURM and Grid Engine jobs' dask workers inherit it): with ``$VSEKIT_TEST_COMMIT_LOG`` set, every row block a
process commits (``FeatureSet.write_block`` returned) appends ``SET BLOCK JOB PID`` to that file; with
``$VSEKIT_TEST_BATCH_DELAY`` set, every extraction batch sleeps that many seconds first (so a test
can act while blocks are in flight). It wraps the store itself, not vsekit's cluster code, so the
counts hold whatever version of that code runs."""

import os

if os.environ.get("VSEKIT_TEST_COMMIT_LOG"):
    import time

    from vsekit.storage.store import FeatureSet

    _log = os.environ["VSEKIT_TEST_COMMIT_LOG"]
    _write_block = FeatureSet.write_block

    def write_block(self, block, *args, **kwargs):
        _write_block(self, block, *args, **kwargs)
        index = block if isinstance(block, int) else block.index
        job = os.environ.get('SLURM_JOB_ID') or os.environ.get('JOB_ID', '-')
        if os.environ.get('SGE_TASK_ID', '').isdigit():   # a task of a Grid Engine array: JOB.TASK
            job += '.' + os.environ['SGE_TASK_ID']
        line = f"{self.name} {index} {job} {os.getpid()} {time.time():.3f}\n"
        fd = os.open(_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    FeatureSet.write_block = write_block

if os.environ.get("VSEKIT_TEST_BATCH_DELAY"):
    import time

    import vsekit.extract.rows as _rows

    _delay = float(os.environ["VSEKIT_TEST_BATCH_DELAY"])
    _run_items = _rows.run_items

    def run_items(*args, **kwargs):
        time.sleep(_delay)
        return _run_items(*args, **kwargs)

    _rows.run_items = run_items
