"""rdlm's engine-config hook: vLLM calls it with the whole engine config before anything is built (its
`VerifyAndUpdateConfig`, found in `MODELS_CONFIG_MAP` under each architecture rdlm registers), so the defaults
a user leaves on give rdlm's tokens.

With an exit criterion the forward must tell a decoded token (which may exit) from a prompt token (which runs
every iteration, as in `rdlm generate`); it reads that from the step's attention metadata: a request with one
new token after earlier ones is decoding. Three of vLLM's defaults break that reading, so the hook turns them
off for such a model, each logged:

- prefix caching: a prompt cached whole has its last token recomputed alone (it would read as decoded and
  may exit), and a follow-up turn would reuse the blocks of generated tokens;
- chunked prefill: a prompt whose last chunk is one token would read as decoded;
- CUDA graphs and vLLM's compilation on an accelerator (`enforce_eager`): the adaptive loop stops when every
  token has exited, a decision the host takes between iterations, which a captured graph cannot hold. The
  CPU captures no graphs: there `enforce_eager` is left as asked.

Speculative decoding is refused by name with an exit criterion: its verify tokens are several new tokens of a
decoding request, which read as prompt tokens, so they would run every iteration.
"""

from __future__ import annotations

import logging

from vllm.config import VllmConfig
from vllm.model_executor.models.config import VerifyAndUpdateConfig
from vllm.platforms import current_platform

from rdlm.integrations.vllm import options

log = logging.getLogger(__name__)


class RecurrenceEngineConfig(VerifyAndUpdateConfig):
    """The engine settings a served recurrence needs (the module doc says which and why)."""

    @staticmethod
    def verify_and_update_config(vllm_config: VllmConfig) -> None:
        hf_config = vllm_config.model_config.hf_config
        _, recurrence = options.read(hf_config.to_dict(), type(hf_config).__name__)
        if recurrence.criterion is None:
            return  # fixed depth: every token runs r iterations, whatever vLLM batches together
        refuse_speculation(vllm_config)
        cache, scheduler = vllm_config.cache_config, vllm_config.scheduler_config
        if cache.enable_prefix_caching:
            cache.enable_prefix_caching = False
            log.info("rdlm: prefix caching off: with rdlm_exit_criterion a cached prompt's last token would exit")
        if scheduler.enable_chunked_prefill:
            scheduler.enable_chunked_prefill = False
            scheduler.long_prefill_token_threshold = 0
            longest = vllm_config.model_config.max_model_len
            # a whole prompt must fit one step
            scheduler.max_num_batched_tokens = max(scheduler.max_num_batched_tokens, longest)
            scheduler.verify_max_model_len(longest)
            log.info("rdlm: chunked prefill off: with rdlm_exit_criterion a prompt's one-token chunk would exit")
        if not vllm_config.model_config.enforce_eager and not current_platform.is_cpu():
            vllm_config.model_config.enforce_eager = True
            log.info("rdlm: enforce_eager on: the exit loop's host decisions cannot sit in a captured graph")


def refuse_speculation(vllm_config: VllmConfig) -> None:
    """An exit criterion with speculative decoding is refused by name (the module doc says why)."""
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise options.RecurrenceOptionError(
            "rdlm_exit_criterion cannot run with speculative decoding (speculative_config): a verify step's "
            "draft tokens cannot be told from prompt tokens inside the forward, so they would not exit; "
            "serve without speculative decoding, or without an exit criterion"
        )
