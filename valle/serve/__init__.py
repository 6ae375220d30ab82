"""A synthesis web page for a checkpoint (``bin/serve.py``; docs/inference.md, "A synthesis page").

``catalog`` finds checkpoints and example prompts, ``engine`` runs synthesis one request at a
time through ``valle.infer``, ``app`` is the FastAPI application and ``cli`` its command line.
FastAPI is imported only by ``app`` and ``cli``.
"""
