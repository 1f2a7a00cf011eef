from engine.models.config import ModelConfig, RotaryConfig
from engine.models.decoder import CausalLM, create_model
from engine.models.weights import dummy_state_dict, load_weight_state_dict

__all__ = ["CausalLM", "ModelConfig", "RotaryConfig", "create_model", "dummy_state_dict", "load_weight_state_dict"]
