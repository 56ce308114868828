"""tilewise service: the HTTP server, codecs, the ``tilewise`` command and the batch client.

Modules: :mod:`service.app` (FastAPI factory), :mod:`service.routes`, :mod:`service.codecs`
(content-sniffed NIfTI / PNG / JPEG / TIFF), :mod:`service.pipeline` (one file through one model,
shared with ``tilewise infer``), :mod:`service.executor` (bounded per-device queue),
:mod:`service.settings`, :mod:`service.errors`; :mod:`service.client` imports neither torch nor
FastAPI.
"""
