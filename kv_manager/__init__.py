"""staticlm.kv_manager: application-owned KV buffers (pure numpy; no onnxruntime here)."""
from .cache import KVCache
from .layered import LayeredKVCache
from .mask import MASK_VALUE, attention_bias, dequantize_bias, mask_quant_params, quantize_bias
from .sizing import choose_bmc_r, kv_bytes
from .spec import ContextFull, KVSpec, KVStats, Overflow, Strategy
from .strategies import BMCCache, ConcatCache, InPlaceCache, PointerCache, ShiftCache, make_kv_cache

__all__ = ["KVCache", "LayeredKVCache", "KVSpec", "KVStats", "Strategy", "Overflow", "ContextFull", "make_kv_cache",
           "PointerCache", "ShiftCache", "InPlaceCache", "ConcatCache", "BMCCache", "attention_bias", "quantize_bias",
           "dequantize_bias", "mask_quant_params", "MASK_VALUE", "kv_bytes", "choose_bmc_r"]
