"""A torch.distributed.Store over the coordinator, so Gloo rendezvous needs the run's credentials.

Keys are prefixed inside the store (PrefixStore over a Python store does not work in torch 2.13).
"""

from __future__ import annotations

import base64
import time
from datetime import timedelta

import torch.distributed as dist

from elastic_mesh.control.client import CoordinatorClient, CoordinatorError


class CoordinatorStore(dist.Store):
    def __init__(self, client: CoordinatorClient, prefix: str, timeout_s: float) -> None:
        super().__init__()
        self.client, self.prefix, self.timeout_s = client, prefix, timeout_s

    def _key(self, key: str) -> str:
        return self.prefix + key

    def set(self, key: str, value) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self.client.post("/v1/store/set", {"key": self._key(key), "value": base64.b64encode(data).decode()})

    def get(self, key: str) -> bytes:
        answer = self._poll("/v1/store/get", {"key": self._key(key)}, f"key {key!r}")
        return base64.b64decode(answer["value"])

    def add(self, key: str, amount: int) -> int:
        return int(self.client.post("/v1/store/add", {"key": self._key(key), "amount": int(amount)})["value"])

    def check(self, keys: list[str]) -> bool:
        return bool(self.client.post("/v1/store/check", {"keys": [self._key(k) for k in keys]})["present"])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._poll("/v1/store/wait", {"keys": [self._key(k) for k in keys]}, f"keys {keys}",
                   timeout.total_seconds() if timeout else None)

    def _poll(self, path: str, body: dict, what: str, timeout_s: float | None = None) -> dict:
        give_up = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            answer = self.client.post(path, body)
            if answer.get("status") == "ok":
                return answer
            if time.monotonic() > give_up:
                raise CoordinatorError(f"rendezvous: {what} did not appear within {timeout_s or self.timeout_s:.0f} s")

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout_s = timeout.total_seconds()

    def clone(self) -> "CoordinatorStore":
        return CoordinatorStore(self.client, self.prefix, self.timeout_s)
