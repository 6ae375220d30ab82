"""Where phonemizer finds libespeak-ng: the library and data shipped by espeakng-loader (no apt
step). Its own module, importing nothing of valle, so every text frontend (valle/data/text.py,
languages.py, vallex_text.py) can call it without importing the others."""

from __future__ import annotations

import threading

_lock = threading.Lock()
_configured = False


def configure_espeak() -> None:
    """Point phonemizer at espeakng-loader's libespeak-ng and its data, once per process."""
    global _configured
    with _lock:
        if _configured:
            return
        import espeakng_loader
        from phonemizer.backend.espeak.wrapper import EspeakWrapper

        EspeakWrapper.set_library(espeakng_loader.get_library_path())
        EspeakWrapper.set_data_path(espeakng_loader.get_data_path())
        _configured = True
