"""The format: messages and their frames (_wire), every body's schema (_bodies), values
as pickles (_serialize) and chunk tags (_mac). No rules, no sockets."""
