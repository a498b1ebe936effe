"""The `vllm.general_plugins` entry point. vLLM runs `register` in every process it starts (engine core, workers).
It registers the architectures ragcache links for again, as subclasses that only remember the model they built, so
that the connector in the same worker can run the link's recompute with that model's own modules."""

from __future__ import annotations

import functools
import importlib
import weakref

ARCHITECTURES = {
    "LlamaForCausalLM": "vllm.model_executor.models.llama",
    "Qwen2ForCausalLM": "vllm.model_executor.models.qwen2",
}
_built: list[weakref.ref] = []


class PluginNotLoaded(RuntimeError):
    pass


def register() -> None:
    from vllm import ModelRegistry

    for arch, module in ARCHITECTURES.items():
        base = getattr(importlib.import_module(module), arch)
        if arch not in globals():  # module-level, so that the class pickles by name
            globals()[arch] = _remembering(base)
        ModelRegistry.register_model(arch, globals()[arch])


def _remembering(base: type) -> type:
    @functools.wraps(base.__init__)  # vLLM reads the signature to decide how to call it
    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        _built.append(weakref.ref(self))

    return type(base.__name__, (base,), {"__init__": __init__, "__module__": __name__, "__qualname__": base.__name__})


def loaded_model(vllm_config):
    """The model this process built for `vllm_config`'s engine: the one holding the attention layers that engine
    registered (a process may hold several engines)."""
    registered = {id(layer) for layer in vllm_config.compilation_config.static_forward_context.values()}
    for model in (ref() for ref in reversed(_built)):
        if model is not None and any(id(module) in registered for module in model.modules()):
            return model
    raise PluginNotLoaded(
        "no model was built through ragcache's vLLM plugin for this engine: install ragcache into vLLM's "
        "environment (it declares the `vllm.general_plugins` entry point `ragcache`), keep it in VLLM_PLUGINS "
        f"if that is set, and serve one of {', '.join(ARCHITECTURES)}"
    )
