"""pdserve: prefill/decode disaggregated LLM serving."""

