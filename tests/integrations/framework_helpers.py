"""Helpers of the framework tests (imported by name: tests/integrations is on sys.path for its tests)."""


def reset_accelerate_state() -> None:
    """accelerate keeps its state in process-wide singletons (the Hugging Face Trainer's accelerator
    included): a test that builds an Accelerator starts and ends with none."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
