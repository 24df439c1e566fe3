"""Integrations with the ecosystem: transformers (`rdlm.integrations.hf`) and lm-evaluation-harness
(`rdlm.integrations.lm_eval`)."""
