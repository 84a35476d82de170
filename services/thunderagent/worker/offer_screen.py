"""Which hand-offs a worker takes, as far as their names go (``fleet.offers``): the same run
offered again is answered as taken, an offer aborted before it arrived is refused, and each
such late offer is counted by outcome."""

from __future__ import annotations

from thunderagent.fleet import HandledOffers
from thunderagent.schemas import WorkerGenerate
from thunderagent.worker.generation import Generation
from thunderagent.worker.metrics import adapter_metrics


class OfferScreen:
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.offers = HandledOffers()
        """Hand-offs run here or voided by an abort: one arriving again is not run."""
        self.metrics = adapter_metrics()

    def screen(
        self, work: WorkerGenerate, running: Generation | None, now: float
    ) -> tuple[str, str]:
        """(why the offer is taken already, why it is refused): both empty when nothing about
        the request's runs here stands in its way (``running``: this worker's run under the
        request's id). The offers it supersedes are voided whatever the answer: their sender
        moved on."""
        rid = work.request.request_id
        offers = self.offers
        outcome = offers.outcome(work.offer, now)
        # this offer, or one it supersedes (the same run, offered again), ran here already
        ran = outcome is True or any(offers.outcome(o, now) for o in work.supersedes)
        offers.void(now, *work.supersedes)
        # the same hand-off again (its first ack was late, so the sender tried once more):
        # idempotent, the run here is (or was) the one the client is reading
        if running is not None and running.work.reply_subject == work.reply_subject:
            offers.ran(now, work.offer)
            self._late("running")
            return "running here", ""
        if ran:
            offers.ran(now, work.offer)
            self._late("ran")
            return "it ran here already", ""
        if running is not None:
            return "", f"{rid} is already running here, for another client"
        if outcome is False:
            self._late("refused")
            return "", f"this hand-off of {rid} was aborted here before it arrived"
        return "", ""

    def _late(self, outcome: str) -> None:
        self.metrics.late_offers.add(1, {"worker_id": self.worker_id, "outcome": outcome})
