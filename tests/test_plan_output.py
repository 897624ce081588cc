"""Issue 43 row 9: `syncwise plan`'s tables as people read them."""
import json
import re

from syncwise.cli import main

CLUSTER = "examples/clusters/a100-8x2-roce.toml"


def _llama_7b(tmp_path):
    folder = tmp_path / "llama-7b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "max_position_embeddings": 4096}))
    return str(folder / "config.json")


def test_strategy_without_a_layout_says_the_priced_layout_does_not_fit(tmp_path, capsys):
    out_json = tmp_path / "rows.json"
    assert main(["plan", "--strategy", "--cluster", CLUSTER, "--model", _llama_7b(tmp_path), "--global-batch", "256",
                 "--seq-len", "2048", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    note = next(line for line in out.splitlines() if "does not fit" in line)
    assert re.search(r"the priced layout dp=16\S* does not fit: [\d,]+ GiB > 77 GiB usable per GPU", note), note
    assert "--layout" in note
    assert "does not fit" in json.loads(out_json.read_text())["does_not_fit"]
    assert not re.search(r"\de[+-]\d", out), out  # step times in human units, no exponent
    assert re.search(r"│ +\d+(\.\d+)? (ms|s) │", out), out
    # a tie at the precision shown is marked on each of its rows, and the rule that orders it is stated
    assert re.search(r"│ +1= │", out) and "a tie at the precision shown" in out, out


def test_the_layout_column_wraps_between_keys_and_times_read_as_times(tmp_path, capsys):
    assert main(["plan", "--cluster", CLUSTER, "--model", _llama_7b(tmp_path), "--global-batch", "256",
                 "--seq-len", "2048"]) == 0
    out = capsys.readouterr().out
    cells = [line.split("│")[2].strip() for line in out.splitlines() if line.startswith("│")]
    assert cells and all(re.fullmatch(r"([a-z_0-9]+=[^,\s]+,? ?)+", c) for c in cells if c), cells
    assert not re.search(r"\de[+-]\d", out)


def test_human_time_and_tie_places():
    from syncwise.plan.search import human_time
    from syncwise.plan.strategy import Ranked, places
    from syncwise.layout import NO_COMPRESS

    assert [human_time(s) for s in (10_320.4, 6.8183, 0.9124, 0.0000421)] == ["10,320 s", "6.818 s", "912.4 ms",
                                                                                "42.1 µs"]
    rows = [Ranked(n, NO_COMPRESS, None, 1.0, 1.0, t, why_not=w) for n, t, w in
            [("a", 0.998, ""), ("b", 1.0, ""), ("c", 1.2, ""), ("d", 1.21, ""), ("e", 1.3, ""), ("f", None, "no")]]
    assert places(rows) == ["1=", "1=", "3", "4", "5", "-"]
