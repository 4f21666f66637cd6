"""Export the remote code of an S2Llama checkpoint, so that it loads with ``trust_remote_code=True`` anywhere.

transformers' own exporter (``custom_object_save``) copies a module plus the files named by its ``from .x import``
lines, resolved as siblings. It cannot follow ``from .kernels.pattern import`` into this package's ``kernels``
subpackage, so the S2 classes export their files themselves: the configuration and modeling files with
``from .kernels.X import`` rewritten to ``from .X import``, and every kernel file they reach, all flat in the
checkpoint folder. The same code runs from the flat copy (a remote-loaded model re-saves the same files).

This is also why the classes are not ``register_for_auto_class``-ed: that would route ``save_pretrained`` through
``custom_object_save`` (and make transformers treat the model as Hub code in generation and DeepSpeed paths);
``auto_map`` and the code files it would write are written here instead.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from pathlib import Path

logger = logging.getLogger(__name__)

AUTO_MAP = {
    "AutoConfig": "configuration_s2_llama.S2LlamaConfig",
    "AutoModel": "modeling_s2_llama.S2LlamaModel",
    "AutoModelForCausalLM": "modeling_s2_llama.S2LlamaForCausalLM",
    "AutoModelForSequenceClassification": "modeling_s2_llama.S2LlamaForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_s2_llama.S2LlamaForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_s2_llama.S2LlamaForQuestionAnswering",
}
_ENTRY_FILES = ("configuration_s2_llama.py", "modeling_s2_llama.py")
_KERNELS_IMPORT = re.compile(r"^(\s*from\s+)\.kernels\.(\w+)(\s+import)", re.MULTILINE)
# The pattern transformers uses to find the files a module needs (indented, lazy imports included).
_FLAT_RELATIVE_IMPORT = re.compile(r"^\s*from\s+\.(\w+)\s+import", re.MULTILINE)


def export_remote_code(config, save_directory) -> list[Path]:
    """Write the remote code files into ``save_directory`` and point ``config.auto_map`` at them.

    Returns the written paths. Kernel files that are imported but absent from this installation are skipped with a
    warning (``trust_remote_code`` loading then fails on them).
    """
    config.auto_map = {**(getattr(config, "auto_map", None) or {}), **AUTO_MAP}
    save_directory = Path(save_directory)
    save_directory.mkdir(parents=True, exist_ok=True)
    search_dirs = _source_dirs()
    pending, written = list(_ENTRY_FILES), []
    while pending:
        name = pending.pop()
        if any(path.name == name for path in written):
            continue
        source = next((d / name for d in search_dirs if (d / name).is_file()), None)
        if source is None:
            logger.warning("remote code: %s is imported but not found in %s; not exported", name, search_dirs)
            continue
        text = _KERNELS_IMPORT.sub(r"\1.\2\3", source.read_text(encoding="utf-8"))
        destination = save_directory / name
        destination.write_text(text, encoding="utf-8")
        written.append(destination)
        pending.extend(f"{module}.py" for module in _FLAT_RELATIVE_IMPORT.findall(text))
    return written


def _source_dirs() -> list[Path]:
    """This file's folder, then the kernels subpackage (present in the installed package, absent in a flat copy)."""
    here = Path(__file__).resolve().parent
    dirs = [here]
    if __package__:
        spec = importlib.util.find_spec(f"{__package__}.kernels")
        if spec is not None and spec.submodule_search_locations:
            dirs.extend(Path(location) for location in spec.submodule_search_locations)
    return dirs
