"""Model sources: the embedded default, a GGUF file, or a HF checkpoint directory, each read into a LoadedModel."""
from .default_model import default_gguf_path
from .load import DEFAULT_NAMES, load_model
from .model import LoadedModel, ModelSourceError, UnsupportedSource, required_weight_names

__all__ = ["DEFAULT_NAMES", "LoadedModel", "ModelSourceError", "UnsupportedSource", "default_gguf_path",
           "load_model", "required_weight_names"]
