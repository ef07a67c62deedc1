"""searchrl: train and compare LLM search agents with RL and process supervision on one shared base."""

import logging as _logging

__version__ = "0.1.0"


def _not_cpu_fallback_notice(record: _logging.LogRecord) -> bool:
    # DeepSpeed (imported by accelerate and trl) warns on every CPU-only import that it "was unable to detect"
    # a GPU; on a CPU machine that is expected and nothing a user can act on. Its other messages pass.
    return not record.getMessage().startswith("Setting accelerator to CPU.")


_logging.getLogger("DeepSpeed").addFilter(_not_cpu_fallback_notice)
