"""Fixtures shared by the modules that talk to the session's server through the openai SDK."""
import openai
import pytest


@pytest.fixture(scope="module")
def client(tidal_server):
    return openai.OpenAI(base_url=f"{tidal_server}/v1", api_key="unused", timeout=300, max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id
