"""Upstream /generate fields this server does not implement, accepted at values that ask for
nothing.

Upstream SGLang's GenerateReqInput has fields for features this fork does not have
(multimodal inputs, LoRA, sessions, hidden states, disaggregation, priority scheduling, ...).
A client written for upstream may send them at their defaults (`"lora_path": null`,
`"return_hidden_states": false`, `"log_metrics": true`). Those bodies are served as if the
field were absent; any other value is refused with a 400 naming the field, since silently
ignoring e.g. a LoRA path would return the wrong model's output.
"""

from __future__ import annotations

from typing import Any

# field -> the values that ask for nothing (compared by identity: None, True, False); a
# list of such values (a batch's per-prompt form) asks for nothing too
INERT_GENERATE_FIELDS: dict[str, tuple[Any, ...]] = {
    **{
        name: (None,)
        for name in (
            "input_embeds",
            "image_data",
            "video_data",
            "audio_data",
            "token_ids_logprob",
            "modalities",
            "session_params",
            "lora_path",
            "lora_id",
            "custom_logit_processor",
            "bootstrap_host",
            "bootstrap_port",
            "bootstrap_room",
            "data_parallel_rank",
            "priority",
            "extra_key",
            "custom_labels",
        )
    },
    **{
        name: (False,)
        for name in (
            "return_hidden_states",
            "return_routed_experts",
            "return_entropy",
            "return_bytes",
            "background",
        )
    },
    "log_metrics": (True, False),  # logging only
    "no_logs": (True, False),  # logging only
}


def _inert(value: Any, allowed: tuple[Any, ...]) -> bool:
    if isinstance(value, list):
        return all(_inert(v, allowed) for v in value)
    return any(value is a for a in allowed)


def drop_inert_fields(data: dict[str, Any]) -> str | None:
    """Remove from `data` (a /generate body) the upstream-only fields at inert values, in
    place. Returns the first upstream-only field set to something else (None when there is
    none), which the caller refuses."""
    for name in sorted(set(data) & set(INERT_GENERATE_FIELDS)):
        if not _inert(data[name], INERT_GENERATE_FIELDS[name]):
            return name
        del data[name]
    return None
