"""ragcache inside stock vLLM: a V1 KV connector (`connector.RagcacheConnector`) that links cached chunks into
vLLM's paged KV cache, and a `vllm.general_plugins` entry point (`plugin.register`) that hands the connector the
loaded model. Needs vLLM in the same environment (`make setup-vllm`); nothing here is imported by ragcache itself."""
