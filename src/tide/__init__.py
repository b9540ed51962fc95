"""Tide: per-token early exit for HuggingFace causal LMs, behind the standard transformers API."""

__version__ = "0.1.0"

from .calibration.run import calibrate  # noqa: E402
from .config import TideConfig, TideGenerationConfig  # noqa: E402
from .modeling import TideForCausalLM  # noqa: E402
from .models.architectures import ARCHITECTURES, ArchSpec, register, supported_model_types  # noqa: E402
from .tools.convert import convert_tide_routers  # noqa: E402

__all__ = [
    "__version__",
    "ARCHITECTURES",
    "ArchSpec",
    "TideConfig",
    "TideForCausalLM",
    "TideGenerationConfig",
    "calibrate",
    "convert_tide_routers",
    "register",
    "supported_model_types",
]
