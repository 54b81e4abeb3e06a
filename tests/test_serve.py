"""``examples/serve.py --tiny --check``: a random tiny Llama saved to a temporary folder, served
over HTTP on loopback by transformers' continuous batching with pagedattn's attention; six
concurrent requests get the tokens of transformers' own attention, and pagedattn decoded."""

import importlib.util
import pathlib

import pytest

import pagedattn

transformers = pytest.importorskip("transformers", reason="needs transformers (the examples extra)")

from packaging.specifiers import SpecifierSet  # noqa: E402  (transformers' dependency)

from pagedattn.integrations import transformers as pagedattn_transformers  # noqa: E402

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "examples" / "serve.py"


@pytest.mark.timeout(90)
@pytest.mark.skipif(
    transformers.__version__
    not in SpecifierSet(",".join(pagedattn_transformers.SUPPORTED_VERSIONS)),
    reason=f"transformers {transformers.__version__} is outside the integration's range "
    f"{pagedattn_transformers.SUPPORTED_VERSIONS} (the examples extra installs one inside it)",
)
def test_serve_tiny_answers_concurrent_requests_like_transformers(capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("serve_example", SCRIPT)
    serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve)
    calls = []
    decode = pagedattn.paged_decode

    def spy(*args, **kwargs):
        calls.append(1)
        return decode(*args, **kwargs)

    monkeypatch.setattr(pagedattn, "paged_decode", spy)
    code = serve.main(["--tiny", "--check"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "answers match transformers' own attention: 6/6" in out, out
    assert "with paged|pagedattn on http://127.0.0.1:" in out
    assert calls, "pagedattn.paged_decode never ran"
