"""Who holds which chunks of one broadcast version, as a member's download sees it (member.py)."""

from __future__ import annotations

import base64
import logging
import threading
import time
from typing import TYPE_CHECKING, Callable

from elastic_mesh.control.client import CoordinatorError

if TYPE_CHECKING:
    from elastic_mesh.broadcast.member import BroadcastMember

log = logging.getLogger(__name__)

FIRST_S = 1.0  # a download's first second, when the holder view is refreshed every refresh_first_s


class HolderView:
    """Who holds which chunks of one version, refreshed from the coordinator in the background while a
    download runs (every refresh_first_s in its first second, then every refresh_s: a small version's
    download is round trips more than bytes, a large one's needs no faster view and its members would
    only load the coordinator); the download asks it before every choice."""

    def __init__(self, member: "BroadcastMember", version: int, only: Callable[[dict], bool] | None,
                 known: list[dict] | None = None, guessed: set[str] = frozenset()) -> None:
        """guessed: peers likely to fetch this version too, named with nothing held until the coordinator
        names them (a standing stream to one waits at it for the version to appear)."""
        self.member, self.version, self.only, self.guessed = member, version, only, set(guessed)
        self.current: dict[str, bytes | None] = {}
        self.origins: set[str] = set()  # publishers: asked only for chunks nobody else holds
        self._stop = threading.Event()
        if known:
            self._take(known)
        else:
            self._refresh()
        self._thread = threading.Thread(target=self._run, daemon=True, name="broadcast-holders")
        self._thread.start()

    def _refresh(self) -> None:
        try:
            answer = self.member.client.post("/v1/broadcast/holders", {"kind": self.member.kind,
                                                                       "version": self.version}, retry=False)
        except CoordinatorError as e:
            log.debug("holders of %s %d: %s", self.member.kind, self.version, e)
            return
        self._take(answer["holders"])

    def _take(self, answered: list[dict]) -> None:
        named = {h["address"] for h in answered}
        guessed = [{"address": a, "origin": False, "chunks": ""} for a in self.guessed - named]
        holders = [h for h in [*answered, *guessed]
                   if h["address"] != self.member.address and (self.only is None or self.only(h))]
        self.origins = {h["address"] for h in holders if h["origin"]}
        self.current = {h["address"]: None if h["chunks"] == "all" else base64.b64decode(h["chunks"]) for h in holders}

    def _run(self) -> None:
        started, settings = time.monotonic(), self.member.settings
        while not self._stop.wait(settings.refresh_first_s if time.monotonic() - started < FIRST_S
                                  else settings.refresh_s):
            self._refresh()

    def __call__(self) -> dict[str, bytes | None]:
        return self.current

    def stop(self) -> None:
        self._stop.set()
