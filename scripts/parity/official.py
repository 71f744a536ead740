"""Import helpers for the official qwen-tts 0.1.1 package."""
import importlib.machinery
import sys
import types
import warnings


def ensure_qwen_tts_importable():
    """Make `import qwen_tts` work even when torchaudio cannot load.

    qwen_tts imports torchaudio.compliance.kaldi at package import time, but only its
    25 Hz tokenizer uses it.  A torchaudio built for another CUDA version than torch
    raises at import; the 12 Hz path never touches kaldi, so a placeholder module is
    enough and keeps the official 12 Hz code unchanged.
    """
    try:
        import torchaudio.compliance.kaldi  # noqa: F401
    except (ImportError, RuntimeError, OSError) as err:
        warnings.warn(f"torchaudio unusable ({err}); stubbing torchaudio.compliance.kaldi (25 Hz only)")
        for name in [n for n in sys.modules if n == "torchaudio" or n.startswith("torchaudio.")]:
            del sys.modules[name]
        torchaudio, compliance, kaldi = (_placeholder(n) for n in
                                         ("torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi"))
        torchaudio.compliance = compliance
        compliance.kaldi = kaldi
        sys.modules.update({"torchaudio": torchaudio, "torchaudio.compliance": compliance,
                            "torchaudio.compliance.kaldi": kaldi})


def _placeholder(name):
    # transformers probes optional packages with importlib.util.find_spec, which needs a spec
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)
    return module
