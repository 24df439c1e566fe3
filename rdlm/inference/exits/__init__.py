"""The exit rules (paper section 6.1): the criteria (`criteria`) and the one exit state of a token with its one
update and its one rule of a token done iterating (`track`). Below every other room of rdlm.inference."""
