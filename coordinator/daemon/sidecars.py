"""The coordinator's optional outputs beside its gRPC service: the Prometheus endpoint
(`--metrics-listen`), the web view (`--web`) and the TensorBoard event files
(`--tensorboard`). Each reads the service's live state; none is started when its flag is off.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncio

    from coordinator.daemon.server import CoordinatorService
    from coordinator.daemon.tblog import TensorBoardLog
    from coordinator.web.server import WebServer

log = logging.getLogger(__name__)


async def start_metrics(service: CoordinatorService) -> asyncio.Server | None:
    """The Prometheus endpoint of `--metrics-listen`, or None when it is off."""
    if not service.config.metrics_listen:
        return None
    from coordinator.daemon.metrics import coordinator_registry
    from dtfm.metrics import serve_metrics

    registry = coordinator_registry(service.registry, service.jobs_now, service.links)
    server, _ = await serve_metrics(service.config.metrics_listen, registry)
    return server


async def start_web(service: CoordinatorService) -> WebServer | None:
    """The web view of `--web`, or None when it is off."""
    if not service.config.web_listen:
        return None
    from coordinator.web.server import start_web as serve_web
    from coordinator.web.view import View

    web, _ = await serve_web(service.config.web_listen, service.config.security,
                             View(service.status_answer, service.history_answer))
    return web


def start_tensorboard(service: CoordinatorService) -> TensorBoardLog | None:
    """The event files of `--tensorboard`, or None when it is off."""
    if not service.config.tensorboard_dir:
        return None
    from coordinator.daemon.tblog import TAIL, TensorBoardLog

    log.info("TensorBoard event files in %s", service.config.tensorboard_dir)
    return TensorBoardLog(service.config.tensorboard_dir,
                          lambda: service.history_answer(tail=TAIL), service.status_answer)
