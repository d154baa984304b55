"""Running the app under uvicorn: graceful shutdown on SIGTERM/SIGINT, and exit if the engine dies.

On a signal the engine stops taking requests and ends every running one at once (streams get an
error event and [DONE]; waiting non-streaming clients a 503), so connections close and the process
exits within seconds, never waiting for long generations; `graceful_timeout` bounds what is left.
If the engine thread dies, /health answers 503, every waiting client gets the error, and the server
exits (status 1 from `kvpage serve`), so a supervisor can restart it.
"""

from __future__ import annotations

import uvicorn

DEFAULT_GRACEFUL_TIMEOUT = 5.0


class KvpageServer(uvicorn.Server):
    def __init__(
        self,
        app,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        log_level: str = "warning",
        graceful_timeout: float = DEFAULT_GRACEFUL_TIMEOUT,
        exit_on_engine_death: bool = True,
        root_path: str = "",  # behind a proxy that serves it under this path prefix (and strips it)
    ) -> None:
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, root_path=root_path,
                                timeout_graceful_shutdown=graceful_timeout)  # fmt: skip
        super().__init__(config)
        self.aengine = app.fastapi.state.async_engine
        self.aengine.on_death = self._engine_died
        self.engine_died = False
        self.exit_on_engine_death = exit_on_engine_death  # False: stay up answering 503 (for inspection)

    def handle_exit(self, sig, frame) -> None:  # SIGTERM / SIGINT (uvicorn installs it in the main thread)
        self.aengine.begin_shutdown()
        super().handle_exit(sig, frame)

    def stop(self) -> None:
        """What a signal does, from any thread."""
        self.aengine.begin_shutdown()
        self.should_exit = True

    def _engine_died(self) -> None:  # in the engine thread
        self.engine_died = True
        if self.exit_on_engine_death:
            self.should_exit = True


def serve(app, *, host: str, port: int, log_level: str = "warning", root_path: str = "") -> int:
    """Serve until a signal or the engine's death; the exit status (1 if the engine died)."""
    server = KvpageServer(app, host=host, port=port, log_level=log_level, root_path=root_path)
    server.run()
    return 1 if server.engine_died else 0
