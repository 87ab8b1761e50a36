"""What the server is: the facts its startup line prints and ``/info`` returns, from one dict."""

from __future__ import annotations

from minserve.config import ServerConfig
from minserve.engine.async_engine import AsyncLLMEngine


def server_info(engine: AsyncLLMEngine, model_name: str, config: ServerConfig) -> dict:
    """The model, its numbers and cache (as the engine core measured them), and the server's limits."""
    admission = config.admission if isinstance(config.admission, str) else type(config.admission).__name__
    return {
        "model": model_name,
        **engine.info.facts,
        "admission": admission,
        "max_waiting_requests": config.max_waiting_requests,
        "request_timeout_s": config.request_timeout_s,
        "max_connections": config.max_connections,
        "shutdown_drain_s": config.shutdown_drain_s,
    }


def startup_line(info: dict, url: str) -> str:
    """One line a person reads to know what is serving, and where."""
    kv_bytes = info.get("kv_cache_bytes")
    kv_size = f", {kv_bytes / 2**20:.1f} MiB" if kv_bytes else ""
    return (
        f"minserve ready at {url}: {info['model']} ({info.get('checkpoint')} checkpoint; weights "
        f"{info.get('weights')}; activations {info.get('dtype')}; decode steps "
        f"{'compiled' if info.get('compiled_decode') else 'eager'}; on {info.get('device')}), context "
        f"{info.get('max_model_len')} tokens; KV cache {info.get('kv_cache_blocks')} "
        f"blocks of {info.get('kv_block_size_tokens')} = {info.get('kv_cache_tokens')} tokens{kv_size}; largest "
        f"batch {info.get('max_num_seqs')} sequences / {info.get('max_num_batched_tokens')} tokens a step; "
        f"admission {info['admission']} (max {info['max_waiting_requests']} waiting)"
    )
