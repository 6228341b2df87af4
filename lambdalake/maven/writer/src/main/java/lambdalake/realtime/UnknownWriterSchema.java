package lambdalake.realtime;

/**
 * A record written with a writer schema the Real-time query does not decode yet: it stops the
 * query, which is started again from its checkpoint with the schema (lambdalake/spark/realtime.py
 * reads the id from this message).
 */
public final class UnknownWriterSchema extends RuntimeException {
  private static final long serialVersionUID = 1L;
  public static final String PREFIX = "lambdalake: unknown writer schema id ";

  public UnknownWriterSchema(int schemaId) {
    super(PREFIX + schemaId);
  }
}
