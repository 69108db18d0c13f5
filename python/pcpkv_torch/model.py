"""The former name of pcpkv_torch.model_spec (the model spec read from a HF config), kept so that
``import pcpkv_torch.model`` and every name it had keep working: this name is that module itself."""

import sys

from . import model_spec

sys.modules[__name__] = model_spec
