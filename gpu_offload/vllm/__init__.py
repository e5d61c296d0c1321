"""The vLLM adapter: our host and file tiers as a vLLM ``OffloadingSpec``.

Importing this package imports nothing; its modules import vLLM (through
``compat``) and the torch backend.
"""
