"""The first grammar on the engine's step loop costs what any other does: filling a token mask imports no part of
torch's compiler (llguidance.torch compiles a kernel with torch.compile as it is imported: 4.5 s of imports on the
first structured request's step, seconds more on a busy machine)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from engine.config import EngineConfig
from engine.worker.model_sources import ensure_default_model

ROOT = Path(__file__).resolve().parents[2]

FIRST_GRAMMAR = """
import sys
from engine.output.grammar_compiler import GrammarCompiler
from engine.output.structured_output import token_masks, unpack_mask
from engine.sampling_params import StructuredOutput
from engine.worker.tokenizer_files import load_tokenizer

tokenizer = load_tokenizer(sys.argv[1])
compiler = GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
spec = compiler.compiled(StructuredOutput("json_object"))

class Row:
    grammar = compiler.matcher(spec)

mask, failed = token_masks([Row()], len(tokenizer))
allowed = unpack_mask(mask, len(tokenizer))[0]
opening = tokenizer.convert_tokens_to_ids("{")
print(bool(allowed[opening]), int(allowed.sum()), not failed, "torch._dynamo" in sys.modules)
"""


def test_the_first_grammar_mask_imports_no_compiler():
    model = ensure_default_model(Path(EngineConfig().cache_dir))
    result = subprocess.run(
        [sys.executable, "-c", FIRST_GRAMMAR, str(model)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    opening_allowed, allowed, ok, compiler_imported = result.stdout.split()
    assert opening_allowed == "True" and ok == "True", result.stdout
    assert 0 < int(allowed) < 1000, "a JSON object starts with few tokens"
    assert compiler_imported == "False", "torch._dynamo was imported for the first grammar"
