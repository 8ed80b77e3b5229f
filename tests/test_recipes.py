import pytest

from kvcalib.errors import SettingsError
from kvcalib.recipes import load_recipe, run_recipe


def test_shipped_recipes_parse_into_known_commands():
    steps = load_recipe("recipes/baselines/baselines.toml")
    assert [s.label for s in steps] == ["fp16", "KIVI-2 G=32", "KIVI-2 G=128", "TurboQuant-2", "TurboQuant-3"]
    assert steps[1].arguments == {"seq_len": 1024, "num_samples": 4, "method": "kivi", "bits": 2,
                                  "group_size": 32, "residual": 128}


def test_recipe_steps_run_the_library_functions(tmp_path, tiny_lm, text_file):
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[defaults]\nseq_len = 32\nnum_samples = 1\ndataset = "{text_file}"\n'
                      '[[steps]]\ncommand = "eval"\nmethod = "kivi"\ngroup_size = 8\nresidual = 16\n')
    [(step, result)] = run_recipe(recipe, model=tiny_lm)
    assert step.label == "kivi" and result.tokens == 31


@pytest.mark.parametrize("body,message", [
    ('[[steps]]\ncommand = "fly"\n', "command must be one of"),
    ('[[steps]]\ncommand = "eval"\nmethd = "kivi"\n', "takes no methd"),
    ("[defaults]\n", "no \\[\\[steps\\]\\]"),
    ("not toml [", "could not read recipe"),
])
def test_malformed_recipes_are_refused(tmp_path, body, message):
    recipe = tmp_path / "r.toml"
    recipe.write_text(body)
    with pytest.raises(SettingsError, match=message):
        load_recipe(recipe)


def test_recipe_collects_fits_codebooks_and_evaluates_vecinfer(tmp_path, tiny_lm, text_file):
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        f'[defaults]\nseq_len = 64\nnum_samples = 2\ndataset = "{text_file}"\nactivations = "{tmp_path / "acts"}"\n'
        f'[[steps]]\ncommand = "collect"\nout = "{tmp_path / "acts"}"\nnum_samples = 4\n'
        f'[[steps]]\ncommand = "fit-codebook"\nout = "{tmp_path / "art"}"\nk_config = "d4b6"\nv_config = "d2b5"\niters = 3\n'
        f'[[steps]]\ncommand = "eval"\nmethod = "vecinfer"\nresidual = 16\nartifacts = "{tmp_path / "art"}"\n'
    )
    done = run_recipe(recipe, model=tiny_lm)
    assert [step.command for step, _ in done] == ["collect", "fit-codebook", "eval"]
    assert done[2][1].settings["k"] == "d4b6" and done[2][1].tokens == 2 * 63


def test_shipped_vecinfer_recipes_parse():
    for name in ("vecinfer", "vecinfer-ablation", "vecinfer-transfer", "vecinfer-d8b16"):
        assert any(step.command == "eval" and step.arguments["method"] == "vecinfer"
                   for step in load_recipe(f"recipes/vecinfer/{name}.toml"))
