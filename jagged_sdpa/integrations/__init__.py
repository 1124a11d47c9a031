"""Integrations of jagged_sdpa with other libraries.

Each integration is its own submodule, imported on demand, so that its optional dependency is only
needed by users who ask for it (``from jagged_sdpa.integrations import transformers``).
"""
