"""Stop strings cut streamed text exactly, and never leak a partial stop string."""

from rocforge_rt.engine.stopping import StopStringFilter


def stream(filter_: StopStringFilter, pieces: list[str]) -> tuple[str, bool]:
    out = []
    for piece in pieces:
        text, hit = filter_.push(piece)
        out.append(text)
        if hit:
            return "".join(out), True
    return "".join(out) + filter_.flush(), False


def test_text_without_stop_strings_passes_through_unchanged():
    assert stream(StopStringFilter([]), ["Hello", ", ", "world"]) == ("Hello, world", False)


def test_stop_string_inside_one_piece_cuts_before_it():
    assert stream(StopStringFilter(["END"]), ["abcENDdef"]) == ("abc", True)


def test_stop_string_split_across_pieces_is_found_and_never_emitted():
    f = StopStringFilter(["\n\nUser:"])
    emitted = [f.push(p) for p in ["Sure.", "\n", "\n", "User", ":", " hi"]]
    assert emitted[0] == ("Sure.", False)
    assert emitted[1] == ("", False) and emitted[2] == ("", False) and emitted[3] == ("", False)
    assert emitted[4] == ("", True)


def test_held_back_prefix_is_released_when_it_stops_matching():
    f = StopStringFilter(["STOP"])
    assert f.push("ab ST") == ("ab ", False)
    assert f.push("ART") == ("START", False)


def test_earliest_of_several_stop_strings_wins():
    assert stream(StopStringFilter(["zz", "b"]), ["abczz"]) == ("a", True)


def test_flush_releases_held_back_text_at_the_end():
    f = StopStringFilter(["STOP"])
    assert f.push("xS") == ("x", False)
    assert f.flush() == "S"
