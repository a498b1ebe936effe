"""Integrations with RAG frameworks. Each lives in its own subpackage and needs its optional extra:

ragcache.integrations.llama_index   pip install -e '.[llama-index]'
ragcache.integrations.langchain     pip install -e '.[langchain]'
"""
