"""The HTTP app: a QuartTrio app whose routes are mailboxes into the actor tree."""

from __future__ import annotations

from quart import Response, request
from werkzeug.exceptions import HTTPException, MethodNotAllowed, NotFound

from blazar.errors import error_bytes
from blazar.middleware import test_hooks_enabled
from dialects.edge import respond
from supervisors.actor import ActorError, ActorUnavailable
from supervisors.jobs import JobKind
from supervisors.refusal import Refusal
from supervisors.services import Services

from .admin.keys_routes import blueprint as keys
from .admin.routes import blueprint as admin
from .anthropic.batch_routes import blueprint as anthropic_batches
from .anthropic.batch_routes import run_message_batch
from .anthropic.routes import blueprint as anthropic
from .census import closest_routes
from .current import BlazarApp
from .native.engine_routes import blueprint as native_engine
from .native.fabric_routes import blueprint as fabric
from .native.jobs_routes import blueprint as jobs
from .native.routes import blueprint as native
from .ollama.routes import blueprint as ollama
from .ollama.routes import run_pull
from .openai.audio_routes import blueprint as audio
from .openai.audio_routes import run_audio_job
from .openai.batch_routes import blueprint as openai_batches
from .openai.batch_routes import run_openai_batch
from .openai.images_routes import blueprint as images
from .openai.images_routes import run_image_job
from .openai.realtime_routes import blueprint as realtime
from .openai.requests_routes import blueprint as request_cards
from .openai.responses_routes import blueprint as responses
from .openai.responses_routes import run_background
from .openai.routes import blueprint as openai
from .openai.videos_routes import blueprint as videos
from .openai.videos_routes import run_video_job
from .roles import install as install_roles


def job_kinds(services: Services) -> dict[str, JobKind]:
    """What each kind of job runs (the Job supervisor is started with these by the composition root)."""
    return {
        "responses": JobKind(run=lambda ctx: run_background(services, ctx)),
        "batch": JobKind(run=lambda ctx: run_openai_batch(services, ctx), resumable=True),
        "message_batch": JobKind(run=lambda ctx: run_message_batch(services, ctx), resumable=True),
        "pull": JobKind(run=lambda ctx: run_pull(services, ctx)),
        "audio": JobKind(run=lambda ctx: run_audio_job(services, ctx), inputs=lambda request: [request["input"]]),
        "image": JobKind(run=lambda ctx: run_image_job(services, ctx)),
        "video": JobKind(run=lambda ctx: run_video_job(services, ctx)),
    }


def create_app(services: Services) -> BlazarApp:
    app = BlazarApp("blazar", static_folder=None)
    app.services = services
    # The body cap is enforced by the BodyLimit middleware while reading; Quart's own check
    # would only look at Content-Length.
    app.config["MAX_CONTENT_LENGTH"] = None
    app.config["BODY_TIMEOUT"] = None
    app.config["RESPONSE_TIMEOUT"] = None
    for blueprint in (native, openai, request_cards, native_engine, ollama, anthropic, admin, keys, jobs, responses,
                      fabric, openai_batches, anthropic_batches, audio, realtime, images, videos):
        app.register_blueprint(blueprint)
    install_roles(app)
    if test_hooks_enabled():
        from .native.test_hooks import blueprint as hooks  # only with BLAZAR_TEST_HOOKS=1

        app.register_blueprint(hooks)

    @app.errorhandler(ActorUnavailable)
    async def teach_actor_unavailable(error: ActorUnavailable) -> Response:
        """An actor that did not take or answer a route's message in time: a teaching 503, never a raw 500."""
        message = (f"the gateway is too busy to take this request right now: an internal actor did not answer "
                   f"({error}); retry in a moment, and see GET /api/events or `blazar doctor` if it persists")
        return Response(error_bytes(request.path, 503, message), status=503, headers={"retry-after": "1"},
                        content_type="application/json")

    @app.errorhandler(ActorError)
    async def teach_actor_error(error: ActorError) -> Response:
        """An actor's refusal that a route did not render itself: its own status, message and fix."""
        return respond(Refusal.from_err(error.err), request.path)

    @app.errorhandler(HTTPException)
    async def teach_http_error(error: HTTPException) -> Response:
        method, path = request.method, request.path
        if isinstance(error, NotFound):
            close = closest_routes(app, method, path)
            hint = f" Closest routes: {', '.join(close)}." if close else ""
            message = (f"no route {method} {path}.{hint} GET /.well-known/blazar lists every route "
                       "this gateway serves.")
            return Response(error_bytes(path, 404, message, closest=close), status=404,
                            content_type="application/json")
        if isinstance(error, MethodNotAllowed):
            allowed = sorted(set(error.valid_methods or []) - {"HEAD", "OPTIONS"})
            message = f"{path} does not accept {method}; use {' or '.join(allowed)}."
            return Response(error_bytes(path, 405, message), status=405,
                            headers={"allow": ", ".join(allowed)}, content_type="application/json")
        status = error.code or 500
        return Response(error_bytes(path, status, error.description or error.name), status=status,
                        content_type="application/json")

    return app

