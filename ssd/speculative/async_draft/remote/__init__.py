"""SSD's draft on another machine: the ``ssd draft-serve`` server and the authenticated channel it speaks over."""
