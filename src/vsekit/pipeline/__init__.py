"""Named pipelines (``pipelines.yaml``) run stage by stage through the CLI's own commands.

``load_file`` reads and structurally checks the file; ``resolve_pipeline`` validates one pipeline
against the Click commands; ``plan`` decides what runs and why; ``run_pipeline`` does it.
"""

from .executor import (RunResult, Step, fingerprint, list_pipelines, load_pipelines, plan, run,  # noqa: F401
                       run_pipeline)
from .resolve import ResolvedStage, check_file, resolve_pipeline  # noqa: F401
from .spec import PipelineError, PipelineFile, PipelineSpec, StageSpec, load_file  # noqa: F401
from .summary import metrics_table  # noqa: F401
