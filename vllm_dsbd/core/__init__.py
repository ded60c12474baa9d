"""DSBD's algorithm in pure torch (no vLLM import): joint scoring, sampling without replacement, the draft forest and
its layout, exact verification, the width policy, and a slow reference decoder used as the test oracle."""
from . import reference
from .forest import Forest, ForestLayout, forest_layout
from .joint import joint_logprobs
from .outputs import iteration_outputs
from .params import BatchParams
from .sampling import BeamStep, beam_step
from .verify import VerifyResult, verify_forest, verify_layer
from .width import choose_width

__all__ = ["reference", "Forest", "ForestLayout", "forest_layout", "joint_logprobs", "iteration_outputs",
           "BatchParams", "BeamStep", "beam_step", "VerifyResult", "verify_forest", "verify_layer", "choose_width"]
