"""versioned_output: the data version reaches the output, and Dagster's beta warning does not reach the terminal."""

import warnings

import dagster as dg

from assets.outputs import versioned_output


def test_versioned_output_carries_its_data_version_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        output = versioned_output([1, 2], {"rows": 2}, "abc123")
    assert output.data_version == dg.DataVersion("abc123") and output.metadata["rows"].value == 2
    with warnings.catch_warnings(record=True) as caught:  # the filter is scoped to the call: others still warn
        warnings.simplefilter("always")
        dg.Output([1], data_version=dg.DataVersion("x"))
    assert any(issubclass(w.category, dg.BetaWarning) for w in caught)
