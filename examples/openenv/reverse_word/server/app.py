"""The reverse-word environment's server (OpenEnv's create_app: HTTP routes and the /ws session).

uvicorn server.app:app --port 8000        # from examples/openenv/reverse_word
"""

from openenv.core.env_server.http_server import create_app

try:
    from ..models import ReverseWordAction, ReverseWordObservation
    from .reverse_word_environment import ReverseWordEnvironment
except ImportError:
    from models import ReverseWordAction, ReverseWordObservation
    from server.reverse_word_environment import ReverseWordEnvironment

app = create_app(
    ReverseWordEnvironment,
    ReverseWordAction,
    ReverseWordObservation,
    env_name="reverse_word",
    max_concurrent_envs=8,
)


def main(host: str = "127.0.0.1", port: int = 8000):
    import uvicorn

    uvicorn.run(app, host=host, port=port)


if __name__ == "__main__":
    main()
