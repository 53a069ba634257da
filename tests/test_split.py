from qdflash.data.split import content_key, mostly_ascii, normalize, select_prompts, split_pool, unit_interval


def texts(n, prefix="prompt"):
    return [f"{prefix} number {i}" for i in range(n)]


def test_normalize_ignores_case_and_whitespace():
    assert normalize("  Hello\n\tWORLD ") == "hello world"
    assert content_key("Hello   world") == content_key("hello world")
    assert content_key("hello world") != content_key("hello world!")


def test_unit_interval_is_deterministic_and_salted():
    assert unit_interval("abc", "x") == unit_interval("abc", "x")
    assert unit_interval("abc", "x") != unit_interval("abc", "y")
    values = [unit_interval(t, "s") for t in texts(2000)]
    assert all(0 <= v < 1 for v in values)
    assert 0.45 < sum(v < 0.5 for v in values) / len(values) < 0.55  # roughly uniform


def test_split_is_deterministic_and_independent_of_order():
    pool = texts(500)
    train1, held1 = split_pool(pool, text=str, heldout_fraction=0.2)
    train2, held2 = split_pool(list(reversed(pool)), text=str, heldout_fraction=0.2)
    assert set(train1) == set(train2) and set(held1) == set(held2)
    assert not set(train1) & set(held1)
    assert 0.1 < len(held1) / len(pool) < 0.3


def test_selection_grows_monotonically():
    pool = texts(300)
    small, _ = select_prompts(pool, text=str, n=10)
    large, _ = select_prompts(list(reversed(pool)), text=str, n=40)
    assert small == large[:10]  # asking for more never changes what was already chosen


def test_selection_dedupes_and_skips_forbidden_and_rejected():
    pool = ["A question", "a   QUESTION", "another one", "forbidden item", "too long " * 50, "last"]
    forbidden = {content_key("Forbidden item")}
    chosen, skipped = select_prompts(pool, text=str, n=10, forbidden=forbidden, accept=lambda t: len(t) < 100)
    assert len(chosen) == 3
    assert {content_key(c) for c in chosen} == {content_key("a question"), content_key("another one"), content_key("last")}
    assert skipped == {"duplicate": 1, "evaluation_item": 1, "rejected": 1}


def test_mostly_ascii():
    assert mostly_ascii("Write a poem about the sea.")
    assert not mostly_ascii("写一首关于大海的诗")
    assert not mostly_ascii("")


def test_normalize_is_the_regex_whitespace_collapse():
    """normalize joins str.split() (fast); content keys and splits were defined by the regex form."""
    import re

    from qdflash.data.split import normalize

    texts = ["  Hello\tWORLD \n", "a\u00a0b\u2003c\u3000d", "x\x1cy\x1fz\x85w", "", " \n\t ", "no-space", "É  é\u2028ß"]
    for text in texts:
        assert normalize(text) == re.sub(r"\s+", " ", text).strip().lower()
