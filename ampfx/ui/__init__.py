"""What users touch that is not the compiler: the command line, the demo, the HTML page and the plots."""
