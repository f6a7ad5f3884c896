"""Models: config, registry, layers, the ViT family (and, registered on import, the other families)."""

from vitrim.models import cnn, dynamic_vit, families, vit_models  # noqa: F401  (register their names)
from vitrim.models.config import ViTConfig
from vitrim.models.registry import build_model, list_models, register_model
from vitrim.models.vit import VisionTransformer, ViTOutput

__all__ = ["ViTConfig", "ViTOutput", "VisionTransformer", "build_model", "list_models", "register_model"]
