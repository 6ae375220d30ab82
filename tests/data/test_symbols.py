import pytest

from valle.data.symbols import SymbolTable


def test_reserved_ids_and_roundtrip_in_k2_format(tmp_path):
    table = SymbolTable.from_symbols({"ə", "h", ",", "_", "oʊ"})
    assert table.symbols[:4] == ["<eps>", "<pad>", "<bos>", "<eos>"]
    assert (table.pad_id, table.bos_id, table.eos_id) == (1, 2, 3)
    path = tmp_path / "tokens.k2symbols"
    table.to_file(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "<eps> 0"
    assert all(len(line.split()) == 2 and line.split()[1].isdigit() for line in lines)
    again = SymbolTable.from_file(path)
    assert again == table
    assert again.symbols == table.symbols
    assert len(again) == 9
    for sym in table.symbols:
        assert again[again[sym]] == sym


def test_reads_a_k2_table_written_elsewhere(tmp_path):
    path = tmp_path / "words.txt"
    path.write_text("<eps> 0\nb 2\na 1\n", encoding="utf-8")
    table = SymbolTable.from_file(path)
    assert table.symbols == ["<eps>", "a", "b"]
    assert table.add("c") == 3
    assert table.add("a") == 1
    assert "c" in table and 3 in table and "z" not in table


def test_errors_name_the_symbol(tmp_path):
    table = SymbolTable()
    with pytest.raises(KeyError, match="'ʒ'"):
        table.get("ʒ")
    with pytest.raises(ValueError):
        table.add("a b")
    bad = tmp_path / "bad.txt"
    bad.write_text("a 0\n", encoding="utf-8")
    with pytest.raises(ValueError, match="<eps>"):
        SymbolTable.from_file(bad)
    dup = tmp_path / "dup.txt"
    dup.write_text("<eps> 0\na 1\nb 1\n", encoding="utf-8")
    with pytest.raises(ValueError, match="duplicate id"):
        SymbolTable.from_file(dup)
