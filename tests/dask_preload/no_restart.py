"""A dask worker preload (``distributed.worker.preload``) for tests/test_extract_cluster.py: each
worker name starts once; when its nanny restarts it, the new worker tells the nanny not to restart
it again and exits, as a worker whose nanny gives up: the cluster's workers end up all gone and not
coming back. ``$VSEKIT_TEST_STARTED``: the folder that records the names already started."""

import os
from pathlib import Path


async def dask_setup(worker):
    mark = Path(os.environ["VSEKIT_TEST_STARTED"]) / str(worker.name)
    if not mark.exists():
        mark.touch()
        return
    await worker.rpc(worker.nanny).close_gracefully(reason="test: no restart")
    os._exit(1)
