"""The scheduler's side of structured outputs: a request with a grammar waits here, outside the scheduler, until
its grammar has compiled (on a compile thread: the steps of the others go on); then each step asks for the bitmasks
of the constrained rows it samples, and feeds the kept tokens to their matchers. The matchers, the compile threads
and the bitmasks are structured_output.py's ``StructuredOutputManager``, which imports xgrammar: it is made on a
thread by ``prepare``, once the engine has been idle or at the first grammar, never on the step loop.
"""

from __future__ import annotations

import threading

from serval.engine.request import Request, RequestStatus
from serval.engine.scheduler import Scheduler, SchedulerOutput

# With nothing to run but grammars compiling, a step waits this long for one (rather than spin) and returns.
GRAMMAR_WAIT_S = 0.05
# A server's engine prepares the grammar compiler once it has been idle this long: at once after start-up, the
# import and the compiler (about 2 s of a core) slowed the first requests (one stream by 15% in benchmarks/
# run_peers.py, measured), and a server is rarely idle less than this before its traffic comes.
PREPARE_AFTER_IDLE_S = 2.0


class GrammarScheduler:
    def __init__(self, model_path: str, vocab_size: int, compile_timeout_s: float) -> None:
        self.model_path, self.vocab_size, self.compile_timeout_s = model_path, vocab_size, compile_timeout_s
        self.structured = None  # the StructuredOutputManager, once a grammar needs it (manager)
        self._lock = threading.Lock()  # prepare makes it on a thread
        self._preparing = False
        self._made = threading.Event()  # set once the manager exists
        self._unsubmitted: list[Request] = []  # grammars that came before the manager: submitted when it is made
        self.waiting: dict[str, Request] = {}  # requests whose grammar compiles: not scheduled yet

    def prepare(self) -> None:
        """Imports xgrammar and builds the grammar compiler on a thread now (the first call; later ones do nothing),
        not on the step loop: the import alone took 0.7 s, and on the step loop it stood every stream still. A
        server's engine calls it through ``idle_for``; the first grammar calls it if no idle time came before."""
        if self._preparing:
            return
        self._preparing = True
        threading.Thread(target=lambda: self.manager().prepare(), name="serval-grammar-setup", daemon=True).start()

    def idle_for(self, seconds: float) -> None:
        """The engine has had nothing to do for ``seconds``: it prepares once that reaches PREPARE_AFTER_IDLE_S."""
        if seconds >= PREPARE_AFTER_IDLE_S:
            self.prepare()

    def manager(self):
        """The StructuredOutputManager, made at the first call (xgrammar is imported then)."""
        with self._lock:
            if self.structured is None:
                from serval.engine.structured_output import GrammarCompiler, StructuredOutputManager

                model_path, vocab_size = self.model_path, self.vocab_size
                self.structured = StructuredOutputManager(lambda: GrammarCompiler.for_model(model_path, vocab_size),
                                                          vocab_size, self.compile_timeout_s)
                for request in self._unsubmitted:
                    self.structured.submit(request.request_id, request.sampling_params.structured_outputs)
                self._unsubmitted.clear()
                self._made.set()
            return self.structured

    def __contains__(self, request_id: str) -> bool:
        """Whether the request has a matcher (its grammar compiled)."""
        return self.structured is not None and request_id in self.structured

    def submit(self, request: Request) -> None:
        self.waiting[request.request_id] = request
        with self._lock:
            if self.structured is not None:
                self.structured.submit(request.request_id, request.sampling_params.structured_outputs)
                return
            self._unsubmitted.append(request)  # (the manager is made on a thread, which submits it)
        self.prepare()

    def take_compiled(self, wait: bool) -> tuple[list[Request], dict[str, str]]:
        """The waiting requests whose grammar has compiled, and the errors of those whose grammar did not (both
        leave the wait). ``wait``: nothing else to do, so wait a little for one."""
        if not self._made.is_set() and not self._made.wait(GRAMMAR_WAIT_S if wait else 0):
            return [], {}
        if wait:
            self.structured.wait_compiled(GRAMMAR_WAIT_S)
        ready, failed = self.structured.take_compiled()
        for request_id in failed:
            del self.waiting[request_id]
        return [self.waiting.pop(request_id) for request_id in ready], failed

    def drop_waiting(self, request_id: str) -> bool:
        """Ends a request whose grammar still compiles. False: it was not waiting."""
        request = self.waiting.pop(request_id, None)
        if request is None:
            return False
        with self._lock:
            if self.structured is None:
                self._unsubmitted.remove(request)
                return True
        self.structured.remove(request_id)
        return True

    def remove(self, request_id: str) -> None:
        """Drops an ended request's matcher, if it has one."""
        if request_id in self:
            self.structured.remove(request_id)

    def bitmasks(self, scheduled: SchedulerOutput) -> tuple[dict, dict[str, str]]:
        """Bitmasks for the constrained requests that sample this step (their prompt is computed by its end), and
        the errors of those whose matcher failed."""
        if not self.structured:
            return {}, {}
        wanted = {}
        for request in scheduled.scheduled:
            if request.request_id not in self.structured or request.max_tokens == 0:
                continue
            guesses = scheduled.spec_token_ids.get(request.request_id, [])
            end = request.num_computed_tokens + scheduled.num_scheduled_tokens[request.request_id] - len(guesses)
            if end == request.num_tokens:
                wanted[request.request_id] = guesses
        return self.structured.bitmasks(wanted) if wanted else ({}, {})

    def advance(self, request: Request, new_tokens: list[int], scheduler: Scheduler) -> str | None:
        """Feeds the kept tokens to the request's matcher; a finished grammar ends the request (even one that
        ignores eos), and a refused token (only when every token was masked) fails it: returns its error."""
        if not self.structured.accept(request.request_id, new_tokens):
            scheduler.finish_request(request, RequestStatus.FINISHED_ERROR)
            return "the grammar allowed no token at this position (are logit_bias or min_tokens excluding them?)"
        if self.structured.is_terminated(request.request_id) and not request.status.finished:
            scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
        return None

    def valid_prefix(self, request_id: str, guesses: list[int]) -> list[int]:
        """The first of a request's guesses that its grammar (if any) allows."""
        return self.structured.valid_prefix(request_id, guesses) if request_id in self else guesses
